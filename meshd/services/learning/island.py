"""DiLoCo for an island: a group of processes that train one model with torch.distributed.

An island is what one machine or cluster is to the mesh.  Its processes train
one model with :class:`~torch.nn.parallel.DistributedDataParallel` (gloo on
CPUs, NCCL on GPUs), so after every backward each holds the same averaged
gradient and after every inner step the same parameters.  Only the island's
rank 0 is a member of the meshd group: it holds the node and a
:class:`~.diloco.DiLoCo`, and takes part in the outer exchanges for the
whole island.  The other ranks have no node and never talk to the mesh.

After every inner step rank 0 broadcasts one flag to the island: whether its
parameters were written outside the inner step (an outer step landed, or it
took the group's state when joining or resyncing: :attr:`DiLoCo.version`
moved).  If so it broadcasts its parameters, flattened into one tensor
(:func:`torch.nn.utils.parameters_to_vector`, one ``broadcast``), and every
other rank copies them in.  So every rank leaves :meth:`IslandDiLoCo.step`
holding rank 0's parameters, and the island as a whole is one member of the
group.  Both collectives are torch.distributed's own; nothing here reduces
or gathers by hand.  Buffers (BatchNorm statistics) are not DiLoCo's: DDP
broadcasts rank 0's at every forward (``broadcast_buffers=True``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import trio
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import parameters_to_vector

from .diloco import DiLoCo


class IslandDiLoCo:
    """DiLoCo for an island of ``process_group``'s ranks: every rank calls
    ``await step(samples)`` after its (DDP) backward.

    ``node`` is the meshd node on rank 0 and ``None`` on every other rank;
    ``model`` is the model or its DDP wrapper (DiLoCo names the wrapped
    module's parameters, so an island and a plain member train one model);
    ``inner_opt`` is this rank's optimizer over the model's parameters; the
    other keywords are :class:`DiLoCo`'s and matter on rank 0 only.

    ``samples`` is this rank's batch; rank 0 reports ``samples × island
    size`` to the group, the island's samples when every rank takes the same
    batch (as DDP with a ``DistributedSampler`` does).  Counting exactly
    would cost one more collective every step, for a weight that only
    matters relative to the other members'.

    The collectives run in a worker thread (:func:`trio.to_thread.run_sync`),
    not in the trio loop.  A broadcast returns on its root only once every
    rank took it (measured with gloo: rank 0 waits as long as rank 1 is
    late), and on rank 0 the node shares the trio loop with training: while
    the island waits for a slow rank, or a large model's parameters cross
    it, the node must keep answering hellos (a member silent for three
    heartbeats is not live) and serving its reduced slice to members still
    fetching it (a slice nobody serves is taken as zero by everyone).  The
    other ranks do the same so their own trio tasks keep running; the
    hand-off costs about 0.4 ms a step here (2 loaded cores).  A collective
    cannot be cancelled once it started: the process group's timeout
    (``init_process_group(timeout=...)``) bounds it.  The other ranks copy
    the parameters in within the thread (nothing else touches them while
    ``step`` runs; on GPUs it keeps NCCL's stream order).  Rank 0's
    parameters are copied before its thread starts: if a background resync
    writes them while a broadcast is in flight, the island gets them at the
    next step's broadcast (the step between averages gradients taken at the
    two).
    """

    def __init__(self, node, model: torch.nn.Module, *, inner_opt: torch.optim.Optimizer, group: str,
                 process_group: dist.ProcessGroup | None = None, **diloco):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("an island needs torch.distributed: call init_process_group first")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.size = dist.get_world_size(process_group)
        if self.rank < 0:
            raise ValueError("this process is not in process_group")
        self.model = model.module if isinstance(model, DistributedDataParallel) else model
        self.inner_opt = inner_opt
        self._params = list(self.model.parameters())
        self._device = self._params[0].device
        self._dtype = functools.reduce(torch.promote_types, (p.dtype for p in self._params))  # parameters_to_vector's
        self.diloco = None  # rank 0's member of the group
        if self.rank == 0:
            if node is None:
                raise ValueError("rank 0 talks to the mesh for the island: give it the node")
            self.diloco = self._member(node, self.model, inner_opt=inner_opt, group=group, island=self.size,
                                       **diloco)
        elif node is not None:
            raise ValueError(f"only rank 0 talks to the mesh: rank {self.rank} takes node=None")
        self.steps = 0  # inner steps taken
        self.broadcasts = 0  # parameter broadcasts to the island (rank 0's outer steps and resyncs)
        self._seen = 0  # rank 0: the DiLoCo version the island holds

    @staticmethod
    def _member(node, model: torch.nn.Module, *, island: int, **diloco) -> DiLoCo:
        """Rank 0's member of the group: a DiLoCo on ``node``, which tells the group the
        island's size (the group's document shows it)."""
        if not hasattr(node, "service"):
            raise TypeError("this island's rank 0 needs a node opened in its process (meshd.open_node); "
                            "meshd.learning.IslandDiLoCo also takes a running daemon's client")
        member = DiLoCo(node, model, **diloco)
        member.membership.report(island=island)
        return member

    async def aclose(self) -> None:
        """Rank 0 with a daemon's client: end the session (the daemon leaves the group);
        nothing on the other ranks, or with a node (it leaves as the node closes)."""
        if hasattr(self.diloco, "aclose"):
            await self.diloco.aclose()

    async def step(self, samples: int = 0) -> None:
        """One inner step (then ``zero_grad``); on rank 0 the outer exchange when
        due; then every rank holds rank 0's parameters."""
        if self.diloco is not None:
            await self.diloco.step(samples * self.size)
            changed = self.diloco.version != self._seen
            self._seen = self.diloco.version
            with torch.no_grad():
                flat = parameters_to_vector(self._params) if changed else None  # a copy, taken now
            await trio.to_thread.run_sync(self._send, flat)
        else:
            self.inner_opt.step()
            self.inner_opt.zero_grad(set_to_none=True)
            flat = await trio.to_thread.run_sync(self._receive)
        self.steps += 1
        self.broadcasts += flat is not None

    # --- in the worker thread --------------------------------------------------------------------

    def _send(self, flat: torch.Tensor | None) -> None:
        with self._on_device():
            self._broadcast(torch.tensor([flat is not None], dtype=torch.int32, device=self._device))
            if flat is not None:
                self._broadcast(flat)

    def _receive(self) -> torch.Tensor | None:
        with self._on_device():
            flag = torch.zeros(1, dtype=torch.int32, device=self._device)
            self._broadcast(flag)
            if not flag.item():
                return None
            flat = torch.empty(sum(p.numel() for p in self._params), dtype=self._dtype, device=self._device)
            self._broadcast(flat)
            with torch.no_grad():
                for param, value in zip(self._params, flat.split([p.numel() for p in self._params])):
                    param.copy_(value.view_as(param))
            return flat

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, group=self.process_group, group_src=0)

    def _on_device(self):
        """CUDA's current device is per thread: NCCL must run on the parameters'."""
        return torch.cuda.device(self._device) if self._device.type == "cuda" else contextlib.nullcontext()
