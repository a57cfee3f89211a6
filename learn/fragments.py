"""Streaming DiLoCo's schedule: which parameters form fragment p, and when it syncs."""

from __future__ import annotations

import torch


def split(names: list[str], parts: int) -> list[list[str]]:
    """``names`` (parameter names, in model order) in ``parts`` fragments of strided layers.

    A layer is the module a parameter belongs to (its name up to the last
    dot: ``blocks.3.attn.weight`` and ``blocks.3.attn.bias`` are one layer),
    so a layer's weight and bias always travel together; layer i (in order of
    first appearance) goes to fragment i % parts, as Streaming DiLoCo strides
    transformer blocks.  ValueError unless 1 <= parts <= the layer count.
    """
    layers: dict[str, list[str]] = {}
    for name in names:
        layers.setdefault(name.rpartition(".")[0], []).append(name)
    if not 1 <= parts <= len(layers):
        raise ValueError(f"fragments must be 1 to {len(layers)} (the model's layers), not {parts}")
    order = list(layers.values())
    return [[name for layer in order[p::parts] for name in layer] for p in range(parts)]


def due(step: int, inner_steps: int, parts: int) -> list[int]:
    """The fragments whose exchange starts after inner step ``step`` (from 1):
    fragment p at the steps ≡ (p+1)·H/P (mod H)."""
    if not 1 <= parts <= inner_steps:
        raise ValueError("fragments must be 1 to inner_steps")
    return [p for p in range(parts)
            if step >= 1 and step % inner_steps == ((p + 1) * inner_steps // parts) % inner_steps]


def overlap_steps(inner_steps: int, parts: int, overlap: int | None = None) -> int:
    """τ, the inner steps a fragment's exchange runs in the background before it lands:
    ``overlap``, or by default H/(2P) (at least 1).  ValueError unless 1 <= ``parts`` <=
    H and, with ``parts`` > 1, 1 <= τ <= H/P (one fragment in flight at a time)."""
    if type(inner_steps) is not int or inner_steps < 1:
        raise ValueError("inner_steps must be a positive integer")
    if type(parts) is not int or not 1 <= parts <= inner_steps:
        raise ValueError(f"fragments must be 1 to inner_steps ({inner_steps}), not {parts!r:.20}")
    tau = overlap if overlap is not None else max(1, inner_steps // (2 * parts))
    if parts > 1 and (type(tau) is not int or not 1 <= tau <= inner_steps // parts):
        raise ValueError(f"overlap must be 1 to H/P ({inner_steps // parts}) inner steps, not {tau!r:.20}")
    return tau


def lands(step: int, inner_steps: int, parts: int, overlap: int) -> list[int]:
    """The fragments whose exchange, started ``overlap`` inner steps before (:func:`due`),
    lands after inner step ``step``."""
    return due(step - overlap, inner_steps, parts) if step > overlap else []


def acting(step: int, inner_steps: int, parts: int, overlap: int) -> list[int]:
    """The fragments a (Streaming) DiLoCo member acts on after inner step ``step``, in
    order: with ``parts`` 1 the outer sync's (every ``inner_steps`` steps), otherwise those
    whose exchange starts (:func:`due`) or lands (:func:`lands`) then."""
    if parts == 1:
        return due(step, inner_steps, 1)
    return sorted(set(due(step, inner_steps, parts)) | set(lands(step, inner_steps, parts, overlap)))


def mix(local: torch.Tensor, global_: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """α·local + (1−α)·global."""
    return alpha * local + (1 - alpha) * global_
