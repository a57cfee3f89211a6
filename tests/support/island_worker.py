"""One rank of one island, for tests/node/test_learning_islands.py (run by ``meshd.testing.run_ranks``).

:func:`island_rank` joins its island's gloo process group (a FileStore
rendezvous; gloo's own connections on 127.0.0.1), wraps a small model
(initialised from the island's number, so islands start apart and one takes
the other's state) in DDP and trains it with
:class:`meshd.learning.IslandDiLoCo`.  Rank 0 opens an in-process meshd node
bootstrapped to the address it is given and waits until the group has
``islands`` live members before its first step.
"""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import trio
from torch.nn.parallel import DistributedDataParallel

import meshd
import meshd.learning as ml
import meshd.node
from meshd.identity import PeerId
from meshd.services.learning import LearningSection

GROUP = "islands"


def params_hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def island_rank(island: int, rank: int, size: int, *, islands: int, store: str, bootstrap: str, data_dir: str,
                steps: int, inner_steps: int, check_at: int, daemon: str | None = None) -> dict:
    """Train as rank ``rank`` of island ``island``; returns the hash of the
    parameters after step ``check_at`` (mid-round) and at the end, how many
    meshd nodes this process built, and, on rank 0, what its group saw.  With
    ``daemon`` (a running node's data dir) rank 0 opens no node: that node is
    the island's member, through a client of its control socket."""
    built = _count_nodes()
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    try:
        result = trio.run(_main, island, rank, islands, bootstrap, Path(data_dir), steps, inner_steps, check_at,
                          daemon)
    finally:
        dist.destroy_process_group()
    return {**result, "island": island, "rank": rank, "nodes_built": len(built)}


def _count_nodes() -> list:
    """Note every meshd node this process builds (rank 0 builds one, the others none)."""
    built, init = [], meshd.node.Node.__init__

    def counted(self, *args, **kwargs):
        built.append(self)
        init(self, *args, **kwargs)

    meshd.node.Node.__init__ = counted
    return built


def _config() -> meshd.Config:
    cfg = meshd.Config()
    cfg.learning = LearningSection(heartbeat_interval=0.2, discover_interval=0.5, round_timeout_min=5.0)
    return cfg


async def _main(island, rank, islands, bootstrap, data_dir, steps, inner_steps, check_at, daemon) -> dict:
    torch.manual_seed(island)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    ddp = DistributedDataParallel(model)  # rank 0's initial parameters reach the island here
    kw = dict(inner_opt=torch.optim.SGD(ddp.parameters(), lr=0.05), group=GROUP, inner_steps=inner_steps)
    gen = torch.Generator().manual_seed(1000 * island + rank)  # every rank its own data
    if rank != 0:
        return await _train(ml.IslandDiLoCo(None, ddp, **kw), ddp, gen, steps, check_at)
    if daemon is not None:
        async with meshd.connect(daemon) as client:
            return await _through_daemon(ml.IslandDiLoCo(client, ddp, **kw), client, islands, ddp, gen, steps,
                                         check_at)
    async with meshd.open_node(data_dir, listen="127.0.0.1:0", bootstrap=[bootstrap], config=_config()) as node:
        await node.connect(bootstrap)
        opt = ml.IslandDiLoCo(node, ddp, **kw)
        group = opt.diloco.group
        while len(group.live()) < islands:
            await group._heard.wait()
        members = [m.hex() for m in group.live()]  # who the group is (at the end, one that finished may have left)
        out = await _train(opt, ddp, gen, steps, check_at)
        await _others_finished(group, node.service("learning").config.heartbeat_interval)
        reports = opt.diloco.reports
        return {**out, "peer": node.peer_id.key.hex(), "members": members,
                "contributors": [r.contributors for r in reports], "missing": sum(r.missing_values for r in reports),
                "state_hash": group.hash.hex() if group.hash else None, "hash_round": group.hash_round,
                "samples": sorted(group.samples.values()),  # each member's, in the last round this one reduced
                "island_size": opt.diloco.membership.island}  # what the group's document says of the island


async def _through_daemon(opt, client, islands, ddp, gen, steps: int, check_at: int) -> dict:
    """Rank 0 of an island whose member is a running node: what :func:`_main` returns for a
    node of its own, as that node's ``learning.status`` says it (asked again until it holds)."""
    await opt.diloco.join()
    with trio.fail_after(30):
        while await opt.diloco.live() < islands:
            await trio.sleep(0.05)
    members = [_key(row["peer"]) for row in (await client.learning_status(GROUP))["members"]]
    out = await _train(opt, ddp, gen, steps, check_at)
    with trio.fail_after(30):  # as _others_finished: they may still fetch the slice this member reduced
        while True:
            rows = (await client.learning_status(GROUP))["members"]  # the live ones first, then those gone
            if all(row["hash_round"] >= opt.diloco.hash_round for row in rows if row["round"] is not None):
                break
            await trio.sleep(0.05)
    await opt.aclose()
    mine = next(row for row in rows if row["me"])
    reports = opt.diloco.reports
    return {**out, "peer": _key(mine["peer"]), "members": members,
            "contributors": [r.contributors for r in reports], "missing": sum(r.missing_values for r in reports),
            "state_hash": opt.diloco.hash.hex() if opt.diloco.hash else None, "hash_round": opt.diloco.hash_round,
            "samples": sorted(row["samples"] for row in rows), "island_size": mine["island"]}


def _key(peer: str) -> str:
    return PeerId.from_string(peer).key.hex()


async def _others_finished(group, heartbeat: float) -> None:
    """Wait until every other member has said it finished our last round, or
    gone quiet: until then one may still fetch the slice this member reduced.
    (A member going quiet is no event: the condition is looked at again every
    heartbeat.)"""
    group.wake.set()  # tell them now that we finished
    while any(m.hash_round < group.hash_round for k, m in group.view.members.items() if k in group.live()):
        with trio.move_on_after(heartbeat):
            await group._heard.wait()


async def _train(opt, ddp, gen, steps: int, check_at: int) -> dict:
    out = {}
    for step in range(1, steps + 1):
        x = torch.randn(16, 8, generator=gen)
        torch.nn.functional.mse_loss(ddp(x), x[:, :2].sum(1, keepdim=True).expand(-1, 2)).backward()
        await opt.step(samples=len(x))
        if step == check_at:
            out["mid"] = params_hash(ddp.module)
    return {**out, "final": params_hash(ddp.module), "broadcasts": opt.broadcasts}
