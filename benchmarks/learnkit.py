"""What the learning benchmarks share: the digits data, the MLP, and a group of in-process members.

Every member is a meshd node of its own in the calling process, talking real
QUIC over 127.0.0.1 (DHT, hellos, signed tensor exchanges).
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import torch
import trio

import meshd
from meshd.services.learning import LearningSection

GROUP = "bench"
BATCH = 32


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and test tensors of scikit-learn's digits, scaled to [0, 1], a fixed split."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    return x[:1437], y[:1437], x[1437:], y[1437:]


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * 4 for p in model.parameters())


def batches(x, y, member: int, step: int):
    """Member ``member``'s batch at ``step`` (sampling with a per-member stream)."""
    gen = torch.Generator().manual_seed(member * 1_000_003 + step)
    idx = torch.randint(len(x), (BATCH,), generator=gen)
    return x[idx], y[idx]


def config() -> meshd.Config:
    cfg = meshd.Config()
    cfg.learning = LearningSection(heartbeat_interval=0.3, discover_interval=1.0, round_timeout_min=5.0)
    return cfg


async def open_members(stack: AsyncExitStack, root: Path, count: int) -> list:
    first = await stack.enter_async_context(meshd.open_node(root / "m0", listen="127.0.0.1:0", config=config()))
    nodes = [first]
    for i in range(1, count):
        node = await stack.enter_async_context(meshd.open_node(
            root / f"m{i}", listen="127.0.0.1:0", bootstrap=[str(first.address)], config=config()))
        await node.connect(first.address)
        nodes.append(node)
    return nodes


async def wait_group(nodes, timeout: float = 30.0) -> None:
    with trio.fail_after(timeout):
        for node in nodes:
            group = node.service("learning").groups[GROUP]
            while len(group.live()) < len(nodes):
                await trio.sleep(0.05)


def split_iid(x, y, members: int):
    return [(x[i::members], y[i::members]) for i in range(members)]


def local_epochs(model, opt, x, y, epochs: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=gen)
        for at in range(0, len(x), BATCH):
            idx = order[at:at + BATCH]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
