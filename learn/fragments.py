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


def mix(local: torch.Tensor, global_: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """α·local + (1−α)·global."""
    return alpha * local + (1 - alpha) * global_
