"""Streaming DiLoCo's schedule: which parameters form fragment p, and when it syncs."""

from __future__ import annotations

import torch


def split(names: list[str], parts: int) -> list[list[str]]:
    """``names`` (in model order) in ``parts`` strided fragments: name i goes to i % parts."""
    if not 1 <= parts <= len(names):
        raise ValueError(f"fragments must be 1 to {len(names)} (the parameter count), not {parts}")
    return [names[p::parts] for p in range(parts)]


def due(step: int, inner_steps: int, parts: int) -> list[int]:
    """The fragments whose exchange starts after inner step ``step`` (from 1):
    fragment p at the steps ≡ (p+1)·H/P (mod H)."""
    if not 1 <= parts <= inner_steps:
        raise ValueError("fragments must be 1 to inner_steps")
    return [p for p in range(parts) if step >= 1 and step % inner_steps == ((p + 1) * inner_steps // parts) % inner_steps]


def mix(local: torch.Tensor, global_: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """α·local + (1−α)·global."""
    return alpha * local + (1 - alpha) * global_
