"""A small real training task for demos, tests and benchmarks: scikit-learn's digits and an MLP.

The data ships with scikit-learn (8x8 images of digits, 10 classes; no
download): 1,437 images to train on and 360 to test, in a fixed order.  The
model is a 64-128-10 MLP (9,610 float32 parameters, 38 kB).

For generative models (the digits DDM run of ``benchmarks/experts.py``):
:func:`digits_data` (the images scaled to [-1, 1], a training split and two
held-out ones), :func:`digit_classifier` (to label generated images) and
:func:`coverage` (how evenly a set of labels covers the classes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

BATCH = 32


def _shuffled() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 images [N, 64] scaled to [0, 1] and their labels [N], in a fixed shuffled order."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[order], y[order]


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and test tensors of scikit-learn's digits, scaled to [0, 1], a fixed split."""
    x, y = _shuffled()
    return x[:1437], y[:1437], x[1437:], y[1437:]


def digits_data(held: int = 300) -> dict[str, torch.Tensor]:
    """The digits for a generative model, scaled to [-1, 1] (pixel 0 → −1, 16 → 1), in three
    disjoint parts of the same fixed order as :func:`digits`: ``held2`` the last ``held``
    images, ``held`` the ``held`` before them, ``train`` the rest (1,797 − 2·held); each
    with its labels (``train_y``, ``held_y``, ``held2_y``).  Two held-out parts, so that
    MMD between them is the floor a model's samples are compared with."""
    x, y = _shuffled()
    if not 0 < held < len(x) / 2:
        raise ValueError(f"held must be positive and leave training images, not {held}")
    x = 2 * x - 1
    a, b = len(x) - 2 * held, len(x) - held
    return {"train": x[:a], "train_y": y[:a], "held": x[a:b], "held_y": y[a:b], "held2": x[b:], "held2_y": y[b:]}


def digit_classifier(x: torch.Tensor, y: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A logistic regression fitted to images ``x`` [N, 64] and labels ``y`` [N] (deterministic):
    a function from images [M, 64] to predicted labels [M] (LongTensor)."""
    from sklearn.linear_model import LogisticRegression

    model = LogisticRegression(max_iter=2000).fit(x.double().numpy(), y.numpy())
    return lambda images: torch.as_tensor(model.predict(images.double().numpy()), dtype=torch.long)


def coverage(labels: torch.Tensor, classes: int = 10, fair: float = 0.5) -> dict:
    """How evenly ``labels`` (class ids in 0 .. classes − 1) cover the classes: ``counts`` per
    class, ``covered`` (how many classes have at least ``fair`` × their fair share n/classes),
    ``entropy`` of the label shares in bits (log2 classes when even, 0 when one class),
    ``max_share`` and ``min_share`` (the largest and smallest class's share)."""
    if labels.numel() == 0:
        raise ValueError("coverage of no labels")
    if int(labels.min()) < 0 or int(labels.max()) >= classes:
        raise ValueError(f"labels must lie in 0 .. {classes - 1}")
    counts = torch.bincount(labels.flatten(), minlength=classes)
    shares = counts.double() / counts.sum()
    nonzero = shares[shares > 0]
    return {"counts": counts.tolist(), "covered": int((shares >= fair / classes).sum()),
            "entropy": float(-(nonzero * nonzero.log2()).sum()) + 0.0,  # + 0.0: one class gives 0.0, not -0.0
            "max_share": float(shares.max()), "min_share": float(shares.min())}


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
