"""Aggregating contributions from strangers: mean, trimmed mean, centered clipping.

``aggregate`` reduces K tensors of one shape in the order given (the caller
sorts contributors, so every member computing it gets the same bits):

* ``mean``: the sample-weighted mean;
* ``trimmed_mean[:f]``: per coordinate, drop the ⌊f·K⌋ (at least one when
  K ≥ 3) largest and smallest values and average the rest;
* ``centered_clip[:tau]``: start at the coordinate-wise median and move, three
  times, by the mean of each contribution's difference clipped to norm tau
  (Karimireddy, He and Jaggi 2021); tau defaults to the median distance of
  the contributions from the median.

One contribution can move a trimmed mean or a clipped center only by a
bounded amount, however large it is.  ``clipped`` names the contributions
that were trimmed or clipped, so a member clipped round after round can be
reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RULES = ("mean", "trimmed_mean", "centered_clip")


@dataclass(frozen=True)
class Rule:
    name: str
    param: float | None = None


@dataclass
class Aggregate:
    value: torch.Tensor
    clipped: list[int]  # indices of contributions trimmed (mostly) or clipped


def parse_rule(text: str) -> Rule:
    """``mean``, ``trimmed_mean``, ``trimmed_mean:0.2``, ``centered_clip``,
    ``centered_clip:1.5``; ValueError for anything else."""
    name, _, param = text.partition(":")
    if name not in RULES or (param and name == "mean"):
        raise ValueError(f"aggregation rule must be mean, trimmed_mean[:fraction] or "
                         f"centered_clip[:tau], not {text!r}")
    if not param:
        return Rule(name)
    try:
        value = float(param)
    except ValueError:
        raise ValueError(f"{name}'s parameter must be a number, not {param!r}") from None
    if name == "trimmed_mean" and not 0 <= value < 0.5:
        raise ValueError("trimmed_mean's fraction must be in [0, 0.5)")
    if name == "centered_clip" and not value > 0:
        raise ValueError("centered_clip's tau must be positive")
    return Rule(name, value)


def aggregate(tensors: list[torch.Tensor], weights: list[float] | None, rule: Rule | str) -> Aggregate:
    """Reduce ``tensors`` (one shape) with ``rule``; ``weights`` apply to ``mean``."""
    rule = parse_rule(rule) if isinstance(rule, str) else rule
    stacked = torch.stack([t.float() for t in tensors])
    k = len(tensors)
    if rule.name == "mean" or k < 3:
        w = torch.tensor(weights if weights else [1.0] * k, dtype=torch.float32)
        value = (stacked * (w / w.sum()).view(-1, *([1] * (stacked.dim() - 1)))).sum(dim=0)
        return Aggregate(value, [])
    if rule.name == "trimmed_mean":
        trim = max(1, int((0.2 if rule.param is None else rule.param) * k))
        trim = min(trim, (k - 1) // 2)
        ordered, order = stacked.sort(dim=0)
        value = ordered[trim:k - trim].mean(dim=0)
        kept = torch.zeros_like(stacked, dtype=torch.bool).scatter_(0, order[trim:k - trim], True)
        trimmed_share = 1 - kept.flatten(1).float().mean(dim=1)
        return Aggregate(value, [i for i in range(k) if trimmed_share[i] > 0.5])
    flat = stacked.flatten(1)
    center = flat.median(dim=0).values
    distances = (flat - center).norm(dim=1)
    tau = rule.param if rule.param is not None else float(distances.median())
    scale = torch.ones(k)
    for _ in range(3):
        diff = flat - center
        norms = diff.norm(dim=1)
        scale = torch.clamp(tau / torch.clamp(norms, min=1e-12), max=1.0)
        center = center + (diff * scale[:, None]).mean(dim=0)
    return Aggregate(center.view_as(stacked[0]), [i for i in range(k) if scale[i] < 0.999])
