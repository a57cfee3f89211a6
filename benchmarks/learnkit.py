"""What the learning benchmarks share: the digits data, the MLP, and a group of in-process members.

Every member is a meshd node of its own in the calling process, talking real
QUIC over 127.0.0.1 (DHT, hellos, signed tensor exchanges).
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from pathlib import Path

import torch
import trio

import meshd
from meshd.services.learning import LearningSection
from meshd.testing.digits import BATCH, accuracy, batches, digits, mlp, model_bytes, split_iid

__all__ = ["BATCH", "GROUP", "SERVICE_TIMINGS", "accuracy", "batches", "config", "data_parallel", "digits",
           "diloco_run", "gossip_deep_mlp", "local_epochs", "mlp", "model_bytes", "open_members", "split_classes",
           "split_iid", "train_diloco", "wait_group"]

GROUP = "bench"

# [learning] timings as the service ships them (hellos every 2 s, a member silent for 6 s is not
# live, DHT lookups every 10 s), for :func:`open_members`.  :func:`config`'s faster default (0.3 s,
# dead after 0.9 s) loses members for good on a loaded 2-core machine: one hello or provider lookup
# can take a second there, and a member gone stale is never greeted again (Group.to_greet).
SERVICE_TIMINGS = dict(heartbeat_interval=2.0, discover_interval=10.0)


def config(**learning) -> meshd.Config:
    """A node's config: ``[learning]`` with fast heartbeats unless ``learning`` says otherwise."""
    cfg = meshd.Config()
    cfg.learning = LearningSection(**{"heartbeat_interval": 0.3, "discover_interval": 1.0,
                                      "round_timeout_min": 5.0, **learning})
    return cfg


async def open_members(stack: AsyncExitStack, root: Path, count: int, **learning) -> list:
    """``count`` nodes bootstrapped from the first; ``learning``: [learning] keys for :func:`config`."""
    first = await stack.enter_async_context(meshd.open_node(root / "m0", listen="127.0.0.1:0",
                                                            config=config(**learning)))
    nodes = [first]
    for i in range(1, count):
        node = await stack.enter_async_context(meshd.open_node(
            root / f"m{i}", listen="127.0.0.1:0", bootstrap=[str(first.address)], config=config(**learning)))
        await node.connect(first.address)
        nodes.append(node)
    return nodes


async def wait_group(nodes, timeout: float = 30.0) -> None:
    with trio.fail_after(timeout):
        for node in nodes:
            group = node.service("learning").groups[GROUP]
            while len(group.live()) < len(nodes):
                await trio.sleep(0.05)


async def train_diloco(opts, models, data, steps: int, schedules=None) -> float:
    """Every member trains at once until the group's step count (``opts[m].steps``) reaches
    ``steps``, on its own batches (:func:`batches`), each step ending in ``await
    opts[m].step(...)`` (then ``schedules[m].step()``, if given); returns the wall seconds.

    A member that takes a later round's state jumps to that round's step count: counting its
    own calls instead, it went on past the group's last round into one nobody else joined,
    and waited out its timeout.  At most twice ``steps`` calls, so a member that keeps
    taking states still ends.  Each member then calls ``settle``: one whose last
    round came out otherwise takes the group's state."""
    async def train(m: int) -> None:
        x, y = data[m]
        step = 0
        while opts[m].steps < steps and step < 2 * steps:
            step += 1
            bx, by = batches(x, y, m, step - 1)
            torch.nn.functional.cross_entropy(models[m](bx), by).backward()
            await opts[m].step(samples=BATCH)
            if schedules:
                schedules[m].step()
        await opts[m].settle()

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for m in range(len(opts)):
            nursery.start_soon(train, m)
    return time.perf_counter() - started


def split_classes(x, y, members: int, per_member: int = 2):
    """A non-IID split: member m holds ``per_member`` classes, slots m·k to (m+1)·k − 1
    of the classes listed over and over (0 .. C−1, then 1 .. C−1, 0, then 2 ..., each
    pass turned by one), and each class's samples are dealt out evenly among the
    members holding it.  Every sample goes to some member when ``members`` ·
    ``per_member`` >= C (C classes); ValueError otherwise."""
    classes = int(y.max()) + 1
    if members * per_member < classes:
        raise ValueError(f"{members} members holding {per_member} classes each leave a class out")
    passes = -(-members * per_member // classes)
    slots = [(c + p) % classes for p in range(passes) for c in range(classes)]
    held = [set(slots[m * per_member:(m + 1) * per_member]) for m in range(members)]
    parts: list[list[torch.Tensor]] = [[] for _ in range(members)]
    for c in range(classes):
        holders = [m for m in range(members) if c in held[m]]
        idx = (y == c).nonzero().flatten()
        for i, m in enumerate(holders):
            parts[m].append(idx[i::len(holders)])
    return [(x[torch.cat(p)], y[torch.cat(p)]) for p in parts]


def gossip_deep_mlp(seed: int) -> torch.nn.Module:
    """A 64-128-128-128-10 tanh MLP (torch's default init), initialized from ``seed``: the
    gossip benchmark's model, deep enough that plain ``mean`` of independent inits stalls
    (the "vanishing variance"; ``benchmarks/gossip_depth_sim.py`` chose it)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128), torch.nn.Tanh(),
                               torch.nn.Linear(128, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))


def local_epochs(model, opt, x, y, epochs: int, seed: int, batch: int = BATCH) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=gen)
        for at in range(0, len(x), batch):
            idx = order[at:at + batch]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()


def adamw(model: torch.nn.Module, lr_lambda=None):
    """AdamW at lr 1e-3 for ``model`` and its LambdaLR, to step after each inner step:
    ``lr_lambda`` gives the lr at each inner step as a share of 1e-3 (None: 1e-3 throughout)."""
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda or (lambda _: 1.0))


def data_parallel(make_model, data, members: int, steps: int, lr_lambda=None) -> torch.nn.Module:
    """Synchronous data parallel computed centrally: one ``make_model()`` trained with AdamW
    (:func:`adamw`) on the members' batches, their gradients averaged every step; the model."""
    model = make_model()
    opt, schedule = adamw(model, lr_lambda)
    for step in range(steps):
        opt.zero_grad()
        for m, (x, y) in enumerate(data):
            bx, by = batches(x, y, m, step)
            (torch.nn.functional.cross_entropy(model(bx), by) / members).backward()
        opt.step()
        schedule.step()
    return model


async def diloco_run(root: Path, make_model, data, members: int, steps: int, lr_lambda=None, **kw) -> dict:
    """``members`` DiLoCo members (AdamW inside, :func:`adamw`; ``kw`` for DiLoCo) train
    ``make_model()`` on their ``data`` for ``steps`` inner steps: member 0's model,
    bytes each sent in exchanges, whether their hashes agree, rounds, times."""
    import meshd.learning as ml  # noqa: PLC0415  (torch's heavier half, for the runs that train)

    async with AsyncExitStack() as stack:
        nodes = await open_members(stack, root, members, **SERVICE_TIMINGS)
        models = [make_model() for _ in range(members)]
        inner = [adamw(model, lr_lambda) for model in models]
        opts = [ml.DiLoCo(node, model, inner_opt=opt, group=GROUP, **kw)
                for node, model, (opt, _) in zip(nodes, models, inner)]
        await wait_group(nodes)
        wall = await train_diloco(opts, models, data, steps, [schedule for _, schedule in inner])
        hashes = {opt.group.hash for opt in opts}
        sent = [sum(r.bytes_out for r in opt.reports) for opt in opts]  # exchanges, not the initial state
        syncs = [r for opt in opts for r in opt.reports]
        return {"model": models[0], "bytes": sum(sent) / len(sent), "agree": len(hashes) == 1,
                "rounds": max(opt.group.hash_round for opt in opts) + 1, "wall": wall,
                "sync_s": sorted(r.seconds for r in syncs)[len(syncs) // 2] if syncs else 0.0,
                "per_sync": sorted(r.bytes_out for r in syncs)[len(syncs) // 2] if syncs else 0,
                "peak_sync": max((r.bytes_out for r in syncs), default=0),
                "resyncs": sum(opt.resyncs for opt in opts)}
