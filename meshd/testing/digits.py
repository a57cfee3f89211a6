"""A small real training task for demos, tests and benchmarks: scikit-learn's digits and an MLP.

The data ships with scikit-learn (8x8 images of digits, 10 classes; no
download): 1,437 images to train on and 360 to test, in a fixed order.  The
model is a 64-128-10 MLP (9,610 float32 parameters, 38 kB).
"""

from __future__ import annotations

import torch

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
    """The 64-128-10 MLP, initialized from ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The share of ``x`` that ``model`` labels as ``y``."""
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def model_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's parameters as float32."""
    return sum(p.numel() * 4 for p in model.parameters())


def batches(x, y, member: int, step: int, size: int = BATCH):
    """Member ``member``'s batch at ``step`` (sampled with a per-member stream, so reproducible)."""
    gen = torch.Generator().manual_seed(member * 1_000_003 + step)
    idx = torch.randint(len(x), (size,), generator=gen)
    return x[idx], y[idx]


def split_iid(x, y, members: int):
    """Member m's share: every ``members``-th sample from m on."""
    return [(x[i::members], y[i::members]) for i in range(members)]
