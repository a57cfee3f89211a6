"""Training across peers, for training scripts: ``import meshd.learning as ml``.

::

    async with meshd.open_node(data_dir, bootstrap=[...]) as node:
        opt = ml.DiLoCo(node, model, inner_opt=torch.optim.AdamW(model.parameters(), 3e-4),
                        group="run42", inner_steps=50)
        for batch in loader:
            model(batch).loss.backward()
            await opt.step(samples=len(batch))
        await opt.settle()      # end in the group's state

``GossipAverager`` is the other algorithm: ``await avg.step()`` after each
round's local epochs.  Both need the node's ``learning`` service (on by
default); see docs/learning.md.

Either takes a client of a running daemon in place of the node: the script
takes its inner steps, the daemon is the group's member for it::

    async with meshd.connect("~/.meshd") as client:
        opt = ml.DiLoCo(client, model, inner_opt=..., group="run42", inner_steps=50)
        ...
        await opt.aclose()      # or leave ``connect``: the daemon leaves the group

``IslandDiLoCo`` is DiLoCo for an island, processes that train one model with
torch.distributed (DDP): every rank calls ``await opt.step(samples)``; rank 0
holds the node (the other ranks pass ``None``), does the outer exchange for
the island and broadcasts the outcome to it::

    dist.init_process_group("nccl")          # or "gloo"
    ddp = DistributedDataParallel(model)
    node = await stack.enter_async_context(meshd.open_node(...)) if dist.get_rank() == 0 else None
    opt = ml.IslandDiLoCo(node, ddp, inner_opt=torch.optim.AdamW(ddp.parameters(), 3e-4),
                          group="run42", inner_steps=50)
"""

from learn.reports import GossipReport, SyncReport

from .client.base import ControlClient
from .client.training import RemoteDiLoCo, RemoteGossipAverager, SessionClosed
from .services.learning import averager, diloco
from .services.learning import island as islands


class DiLoCo(diloco.DiLoCo):
    __doc__ = diloco.DiLoCo.__doc__ + """

    ``node`` is an open node (:func:`meshd.open_node`), or a client of a running
    daemon (:func:`meshd.connect`): then this is a :class:`RemoteDiLoCo`, whose
    daemon is the group's member for this script (docs/learning.md)."""

    def __new__(cls, node, *args, **kwargs):
        if isinstance(node, ControlClient):
            return RemoteDiLoCo(node, *args, **kwargs)
        return super().__new__(cls)


class GossipAverager(averager.GossipAverager):
    __doc__ = averager.GossipAverager.__doc__ + """
    ``node`` is an open node, or a client of a running daemon (:func:`meshd.connect`):
    then this is a :class:`RemoteGossipAverager`."""

    def __new__(cls, node, *args, **kwargs):
        if isinstance(node, ControlClient):
            return RemoteGossipAverager(node, *args, **kwargs)
        return super().__new__(cls)


class IslandDiLoCo(islands.IslandDiLoCo):
    __doc__ = islands.IslandDiLoCo.__doc__ + """
    On rank 0, ``node`` may also be a client of a running daemon (:func:`meshd.connect`):
    the daemon is then the island's member (a :class:`RemoteDiLoCo`), and
    :meth:`aclose` (or leaving ``connect``) ends its session."""

    @staticmethod
    def _member(node, model, *, island: int, **diloco):
        if isinstance(node, ControlClient):
            return RemoteDiLoCo(node, model, island=island, **diloco)
        return islands.IslandDiLoCo._member(node, model, island=island, **diloco)


__all__ = ["DiLoCo", "GossipAverager", "GossipReport", "IslandDiLoCo", "RemoteDiLoCo", "RemoteGossipAverager",
           "SessionClosed", "SyncReport"]
