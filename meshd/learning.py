"""Training across peers, for training scripts: ``import meshd.learning as ml``.

::

    async with meshd.open_node(data_dir, bootstrap=[...]) as node:
        opt = ml.DiLoCo(node, model, inner_opt=torch.optim.AdamW(model.parameters(), 3e-4),
                        group="run42", inner_steps=50)
        for batch in loader:
            model(batch).loss.backward()
            await opt.step(samples=len(batch))

``GossipAverager`` is the other algorithm: ``await avg.step()`` after each
round's local epochs.  Both need the node's ``learning`` service (on by
default); see docs/learning.md.

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

from .services.learning.averager import GossipAverager, GossipReport
from .services.learning.diloco import DiLoCo, SyncReport
from .services.learning.island import IslandDiLoCo

__all__ = ["DiLoCo", "GossipAverager", "GossipReport", "IslandDiLoCo", "SyncReport"]
