"""Learning benchmark: DiLoCo and gossip averaging across meshd nodes, beside central references.

    .venv/bin/python benchmarks/learning.py [--quick] [--members 4] [--steps 600]

Every member is a meshd node of its own (in this one process, talking real QUIC
over 127.0.0.1 through the DHT, hellos and signed tensor exchanges); the data
is scikit-learn's bundled digits (8x8 images, 10 classes; 1,437 to train, 360
to test), the model a 64-128-10 MLP.  In the same run:

1. DiLoCo, ``--members`` members on an IID split, ``--steps`` inner steps of
   AdamW each, H in {10, 50} and H = 50 with int4 pseudo-gradients, and
   Streaming DiLoCo (H = 50, P = 2), beside synchronous data parallel
   computed centrally (the members' gradients averaged every step): test
   accuracy, bytes each member sent in outer exchanges (the one-time state
   transfer to joining members is not counted), the ratio to data parallel's bytes
   (an fp32 all-reduce of the gradient every step: 2 (N-1)/N of the model),
   and whether every member's state hash agreed after every outer round.
2. Gossip, 8 members each with its own random init, IID split, each round 2
   local epochs then a pull from 4 random partners: ``variance_corrected``
   and ``mean`` accuracy by round, beside FedAvg computed centrally (common
   init, same data and epochs).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import torch
import trio
from rich.console import Console
from rich.table import Table

_HERE = Path(__file__).resolve().parent
sys.path[:1] = [str(_HERE.parent)]  # the repo, not this folder (benchmarks/nat.py shadows nat)
sys.path.append(str(_HERE))
import meshd.learning as ml  # noqa: E402
from learnkit import (BATCH, GROUP, accuracy, batches, digits, local_epochs, mlp, model_bytes,  # noqa: E402
                      open_members, split_iid, wait_group)

# --- DiLoCo ---------------------------------------------------------------------------------------


def data_parallel(data, x_test, y_test, members: int, steps: int) -> float:
    model = mlp(0)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    for step in range(steps):
        opt.zero_grad()
        for m, (x, y) in enumerate(data):
            bx, by = batches(x, y, m, step)
            (torch.nn.functional.cross_entropy(model(bx), by) / members).backward()
        opt.step()
    return accuracy(model, x_test, y_test)


async def diloco_run(root: Path, data, x_test, y_test, members: int, steps: int, **kw) -> dict:
    async with AsyncExitStack() as stack:
        nodes = await open_members(stack, root, members)
        models = [mlp(0) for _ in range(members)]
        opts = [ml.DiLoCo(node, model, inner_opt=torch.optim.AdamW(model.parameters(), 1e-3), group=GROUP, **kw)
                for node, model in zip(nodes, models)]
        await wait_group(nodes)
        hashes: list[set] = []

        async def train(m: int) -> None:
            x, y = data[m]
            for step in range(steps):
                bx, by = batches(x, y, m, step)
                torch.nn.functional.cross_entropy(models[m](bx), by).backward()
                await opts[m].step(samples=BATCH)

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for m in range(members):
                nursery.start_soon(train, m)
        hashes = {opt.group.hash for opt in opts}
        sent = [sum(r.bytes_out for r in opt.reports) for opt in opts]  # exchanges, not the initial state
        syncs = [r for opt in opts for r in opt.reports]
        return {"acc": accuracy(models[0], x_test, y_test), "bytes": sum(sent) / len(sent), "agree": len(hashes) == 1,
                "rounds": max(opt.group.hash_round for opt in opts) + 1, "wall": time.perf_counter() - started,
                "sync_s": sorted(r.seconds for r in syncs)[len(syncs) // 2] if syncs else 0.0,
                "per_sync": sorted(r.bytes_out for r in syncs)[len(syncs) // 2] if syncs else 0,
                "resyncs": sum(opt.resyncs for opt in opts)}


# --- gossip ------------------------------------------------------------------------------------------


def fedavg(data, x_test, y_test, rounds: int) -> list[float]:
    global_model = mlp(0)
    out = []
    for r in range(rounds):
        states = []
        for m, (x, y) in enumerate(data):
            local = mlp(0)
            local.load_state_dict(global_model.state_dict())
            local_epochs(local, torch.optim.SGD(local.parameters(), 0.1), x, y, 2, r * 100 + m)
            states.append(local.state_dict())
        global_model.load_state_dict({k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]})
        out.append(accuracy(global_model, x_test, y_test))
    return out


async def gossip_run(root: Path, data, x_test, y_test, members: int, rounds: int, rule: str) -> list[float]:
    async with AsyncExitStack() as stack:
        nodes = await open_members(stack, root, members)
        models = [mlp(100 + m) for m in range(members)]  # each its own init
        avgs = [ml.GossipAverager(node, model, group=GROUP, rule=rule, partners=4, seed=m)
                for m, (node, model) in enumerate(zip(nodes, models))]
        for avg in avgs:
            avg.group.offer("params", 0, avg._named())
        await wait_group(nodes)
        out = []
        for r in range(rounds):
            for m, (x, y) in enumerate(data):
                local_epochs(models[m], torch.optim.SGD(models[m].parameters(), 0.1), x, y, 2, r * 100 + m)
            async with trio.open_nursery() as nursery:
                for avg in avgs:
                    nursery.start_soon(avg.step, len(data[0][0]))
            out.append(sum(accuracy(m, x_test, y_test) for m in models) / members)
        return out


async def main(args) -> None:
    console = Console(width=160)
    x, y, x_test, y_test = digits()
    data = split_iid(x, y, args.members)
    size = model_bytes(mlp(0))
    dp_bytes_per_step = 2 * (args.members - 1) / args.members * size
    table = Table(title=f"DiLoCo, {args.members} members, {args.steps} inner steps, digits MLP "
                        f"({size / 1e3:.0f} kB fp32)", title_justify="left")
    for col in ("run", "test acc", "MB sent / member", "fewer bytes than DP", "median kB / sync",
                "hashes agree", "resyncs", "median sync s"):
        table.add_column(col)
    dp = data_parallel(data, x_test, y_test, args.members, args.steps)
    dp_total = dp_bytes_per_step * args.steps
    table.add_row("data parallel (central)", f"{dp:.3f}", f"{dp_total / 1e6:.1f}", "1x", "-", "-", "-", "-")
    runs = [("H=10", dict(inner_steps=10)), ("H=50", dict(inner_steps=50)),
            ("H=50 int4", dict(inner_steps=50, compression="int4")),
            ("H=50 streaming P=2", dict(inner_steps=50, fragments=2))]
    if args.quick:
        runs = runs[1:3]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, kw) in enumerate(runs):
            r = await diloco_run(Path(tmp) / f"d{i}", data, x_test, y_test, args.members, args.steps, **kw)
            table.add_row(label, f"{r['acc']:.3f}", f"{r['bytes'] / 1e6:.2f}", f"{dp_total / max(r['bytes'], 1):.0f}x",
                          f"{r['per_sync'] / 1e3:.0f}", "yes" if r["agree"] else "NO", str(r["resyncs"]),
                          f"{r['sync_s']:.2f}")
        console.print(table)
        rounds = 4 if args.quick else 10
        gossip = Table(title=f"Gossip, 8 members, own inits, 2 local epochs + pull 4 partners per round",
                       title_justify="left")
        gossip.add_column("rule")
        for r in range(rounds):
            gossip.add_column(f"r{r + 1}")
        gdata = split_iid(x, y, 8)
        gossip.add_row("FedAvg (central, common init)", *(f"{a:.3f}" for a in fedavg(gdata, x_test, y_test, rounds)))
        for i, rule in enumerate(("variance_corrected", "mean")):
            accs = await gossip_run(Path(tmp) / f"g{i}", gdata, x_test, y_test, 8, rounds, rule)
            gossip.add_row(rule, *(f"{a:.3f}" for a in accs))
        console.print(gossip)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two DiLoCo runs and 4 gossip rounds")
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    trio.run(main, parser.parse_args())
