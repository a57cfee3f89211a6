"""Islands benchmark: 2 islands × 2 gloo processes (DDP inside, DiLoCo between) beside 4 plain DiLoCo members.

    .venv/bin/python benchmarks/learning_islands.py [--steps 600] [--inner-steps 50]

Both runs are four real processes (forked by ``meshd.testing.run_ranks``)
training the digits MLP of ``benchmarks/learning.py`` with AdamW (lr 1e-3),
each process its own quarter of the IID split and its own 32-sample batch
every step (``learnkit.batches``, so process k sees the same batches in both
runs), bootstrapped to a meshd node in this process:

1. 4 plain members: every process is a meshd node and a ``DiLoCo`` member.
2. 2 islands × 2: each island is a gloo process group whose ranks train one
   DDP model (each inner step averages the two ranks' gradients); only rank 0
   is a meshd node, an ``IslandDiLoCo`` member, and broadcasts each outer
   step to its rank 1.

Reported: test accuracy, meshd members, MB each member (island) sent on the
mesh in outer exchanges (the one-time state transfer to a joining member is
not counted), whether every outer round had every member and every slice,
states taken after the start (resyncs), whether every process ends with
bit-identical parameters, the parameter broadcasts inside each island, and
wall time (the slowest member's training loop; then the whole run with
process start, gloo and group set-up, the fork server's imports excepted).
A member leaves only once the others said they finished the last round, so
that none misses its reduced slice.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import trio
from rich.console import Console
from rich.table import Table
from torch.nn.parallel import DistributedDataParallel

_HERE = Path(__file__).resolve().parent
sys.path[:1] = [str(_HERE.parent)]  # the repo, not this folder (benchmarks/nat.py shadows nat)
sys.path.append(str(_HERE))
import meshd  # noqa: E402
import meshd.learning as ml  # noqa: E402
from learnkit import BATCH, accuracy, batches, config, digits, mlp, model_bytes, split_iid  # noqa: E402
from meshd.testing.ranks import run_ranks  # noqa: E402

GROUP = "islands-bench"
PROCESSES = 4
PRELOAD = ("__main__", "sklearn.datasets")  # what the fork server imports beside torch


def _hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


# --- one process (in a child) ---------------------------------------------------------------------------


def member(index: int, *, bootstrap: str, root: str, members: int, steps: int, inner_steps: int,
           island_size: int = 1) -> dict:
    """Process ``index`` of the run: a plain member (``island_size`` 1) or rank
    ``index % island_size`` of island ``index // island_size``."""
    torch.set_num_threads(1)
    island, rank = divmod(index, island_size)
    if island_size > 1:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        dist.init_process_group("gloo", init_method=f"file://{root}/island{island}.store", rank=rank,
                                world_size=island_size, timeout=timedelta(minutes=5))
    try:
        return trio.run(functools.partial(_member, index, island, rank, bootstrap=bootstrap, root=Path(root),
                                          members=members, steps=steps, inner_steps=inner_steps,
                                          island_size=island_size))
    finally:
        if island_size > 1:
            dist.destroy_process_group()


async def _member(index, island, rank, *, bootstrap, root, members, steps, inner_steps, island_size) -> dict:
    x, y, x_test, y_test = digits()
    bx_all, by_all = split_iid(x, y, PROCESSES)[index]
    model = mlp(0)
    trained = model
    if island_size > 1:
        trained = DistributedDataParallel(model)  # rank 1 takes rank 0's parameters here
    inner = torch.optim.AdamW(trained.parameters(), 1e-3)

    async def train(opt) -> float:
        started = time.perf_counter()
        for step in range(steps):
            bx, by = batches(bx_all, by_all, index, step)
            torch.nn.functional.cross_entropy(trained(bx), by).backward()
            await opt.step(samples=BATCH)
        return time.perf_counter() - started

    out = {"index": index, "island": island, "rank": rank}
    if rank != 0:
        opt = ml.IslandDiLoCo(None, trained, inner_opt=inner, group=GROUP, inner_steps=inner_steps)
        out["wall"] = await train(opt)
        return {**out, "hash": _hash(model), "broadcasts": opt.broadcasts}
    async with meshd.open_node(root / f"node{index}", listen="127.0.0.1:0", bootstrap=[bootstrap],
                               config=config()) as node:
        await node.connect(bootstrap)
        if island_size > 1:
            opt = ml.IslandDiLoCo(node, trained, inner_opt=inner, group=GROUP, inner_steps=inner_steps)
            diloco = opt.diloco
        else:
            opt = diloco = ml.DiLoCo(node, model, inner_opt=inner, group=GROUP, inner_steps=inner_steps)
        with trio.fail_after(60):
            while len(diloco.group.live()) < members:
                await diloco.group._heard.wait()
        out["wall"] = await train(opt)
        with trio.fail_after(60):
            await _others_finished(diloco.group, node.service("learning").config.heartbeat_interval)
        return {**out, "hash": _hash(model), "acc": accuracy(model, x_test, y_test),
                "bytes": sum(r.bytes_out for r in diloco.reports), "rounds": len(diloco.reports),
                "contributors": min(r.contributors for r in diloco.reports), "resyncs": diloco.resyncs,
                "missing": sum(r.missing_values for r in diloco.reports), "hash_round": diloco.group.hash_round,
                "broadcasts": getattr(opt, "broadcasts", 0)}


async def _others_finished(group, heartbeat: float) -> None:
    """Wait until every other member has said it finished our last round, or
    gone quiet: until then one may still fetch the slice this member reduced."""
    group.wake.set()  # tell them now that we finished
    while any(m.hash_round < group.hash_round for k, m in group.view.members.items() if k in group.live()):
        with trio.move_on_after(heartbeat):  # going quiet is no event: look again every heartbeat
            await group._heard.wait()


def _ready() -> dict:
    return {}


# --- the runs (in this process) -------------------------------------------------------------------------


async def run(tmp: Path, island_size: int, args) -> dict:
    root = tmp / f"size{island_size}"
    root.mkdir()
    async with meshd.open_node(root / "boot", listen="127.0.0.1:0", config=config()) as boot:
        fn = functools.partial(member, bootstrap=str(boot.address), root=str(root),
                               members=PROCESSES // island_size, steps=args.steps, inner_steps=args.inner_steps,
                               island_size=island_size)
        started = time.perf_counter()
        results = await run_ranks([(fn, (i,)) for i in range(PROCESSES)], root, preload=PRELOAD)
        total = time.perf_counter() - started
    heads = [r for r in results if r["rank"] == 0]
    return {"acc": heads[0]["acc"], "members": len(heads),
            "bytes": sum(h["bytes"] for h in heads) / len(heads), "mesh_total": sum(h["bytes"] for h in heads),
            "agree": len({r["hash"] for r in results}) == 1, "rounds": heads[0]["rounds"],
            "full_rounds": all(h["contributors"] == len(heads) and not h["missing"] for h in heads),
            "resyncs": sum(h["resyncs"] for h in heads),
            "broadcasts": [r["broadcasts"] for r in results if r["rank"] != 0],
            "wall": max(h["wall"] for h in heads), "total": total}


async def main(args) -> None:
    console = Console(width=180)
    size = model_bytes(mlp(0))
    table = Table(title=f"Islands: DiLoCo H={args.inner_steps}, {args.steps} inner steps of AdamW, "
                        f"{PROCESSES} processes × batch {BATCH}, digits MLP ({size / 1e3:.0f} kB fp32)",
                  title_justify="left")
    for col in ("run", "test acc", "mesh members", "MB sent / member", "MB sent, all", "rounds", "rounds complete",
                "resyncs", "bit-identical", "broadcasts to rank 1", "train s", "run s"):
        table.add_column(col)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        await run_ranks([(_ready, ())], Path(tmp), preload=PRELOAD)  # the fork server's imports, before the clocks
        for label, island_size in (("4 plain members", 1), ("2 islands × 2 (gloo DDP)", 2)):
            r = await run(Path(tmp), island_size, args)
            rows.append(r)
            table.add_row(label, f"{r['acc']:.3f}", str(r["members"]), f"{r['bytes'] / 1e6:.2f}",
                          f"{r['mesh_total'] / 1e6:.2f}", str(r["rounds"]), "yes" if r["full_rounds"] else "NO",
                          str(r["resyncs"]), "yes" if r["agree"] else "NO",
                          ", ".join(map(str, r["broadcasts"])) or "-", f"{r['wall']:.1f}", f"{r['total']:.1f}")
    console.print(table)
    gap = abs(rows[0]["acc"] - rows[1]["acc"])
    same = gap <= 0.01 and all(r["agree"] for r in rows)
    console.print(f"Same result: {'yes' if same else 'NO'}. Meaning: test accuracy within one point (here "
                  f"{100 * gap:.1f}) and, within each run, every process bit-identical after the last outer step. "
                  f"The two runs cannot be bit-identical to each other: an island averages its ranks' gradients "
                  f"every step, 4 members average pseudo-gradients every {args.inner_steps} steps.")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--inner-steps", type=int, default=50)
    trio.run(main, parser.parse_args())
