"""Aggregating contributions from strangers: mean, trimmed mean, centered clipping.

``aggregate`` reduces K tensors of one shape in the order given (the caller
sorts contributors, so every member computing it gets the same bits; norms
are summed in a fixed order, so the thread count does not change them):

* ``mean``: the sample-weighted mean;
* ``trimmed_mean[:f]``: per coordinate, drop the ⌊f·K⌋ (at least one; f = 0.2
  by default) largest and smallest values and average the rest;
* ``centered_clip[:tau][,iters=n]``: start at the coordinate-wise median and
  move, n times (3 by default), by the mean of each contribution's difference
  clipped to norm tau (Karimireddy, He and Jaggi 2021); tau defaults to the
  median distance of the contributions from the median.

With fewer than three contributions every rule is the weighted mean: two
cannot outvote one.  The robust rules drop a contribution holding a NaN or
an infinity (and take zeros if none is finite); ``mean`` does not.

One contribution can move a trimmed mean or a clipped center only by a
bounded amount (tau/K per iteration), however large it is.  ``clipped``
names the contributions that were dropped, mostly trimmed (more than half
their coordinates) or, in the last iteration, clipped to less than half
their distance from the center (:data:`FAR_OUT`), so a member clipped round
after round can be reported.  Not every clip counts: with the default tau,
the median distance, about half of an honest group is clipped a little in
every round (that is the rule at work), and counting those had honest
members reported as suspects.  :func:`aggregate_state` clips whole state
dicts as one vector: clipping each tensor on its own would let a member move
every tensor by tau/K, √T times tau/K in all for T tensors.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from .tensors import fixed_sum

RULES = ("mean", "trimmed_mean", "centered_clip")
_PARAMS = {"mean": (), "trimmed_mean": ("fraction",), "centered_clip": ("tau", "iters")}
FAR_OUT = 0.5  # centered_clip reports a contribution clipped to less than this share of its distance


@dataclass(frozen=True)
class Rule:
    """A parsed rule: ``param`` is trimmed_mean's fraction or centered_clip's
    tau (None: the default), ``iters`` centered_clip's iterations."""

    name: str
    param: float | None = None
    iters: int = 3


@dataclass
class Aggregate:
    value: torch.Tensor  # float32, the contributions' shape
    clipped: list[int]  # indices of contributions dropped, trimmed (mostly) or clipped


def parse_rule(text: str) -> Rule:
    """``mean``, ``trimmed_mean[:f]`` (f in [0, 0.5), also ``fraction=f``) or
    ``centered_clip[:tau][,iters=n]`` (tau > 0, also ``tau=x``; n from 1 to
    100); ValueError that says so for anything else."""
    name, _, params = text.partition(":")
    if name not in RULES:
        raise ValueError(f"aggregation rule must be mean, trimmed_mean[:fraction] or "
                         f"centered_clip[:tau][,iters=n], not {text!r}")
    fields: dict[str, str] = {}
    for item in params.split(",") if params else ():
        key, eq, value = item.rpartition("=")
        key = key.strip() if eq else (_PARAMS[name] or ("",))[0]
        if key not in _PARAMS[name] or key in fields:
            raise ValueError(f"{name} takes {', '.join(_PARAMS[name]) or 'no parameters'}, not {item!r}")
        fields[key] = value
    number = fields.get("fraction", fields.get("tau"))
    try:
        param = None if number is None else float(number)
        iters = int(fields.get("iters", "3"))
    except ValueError:
        raise ValueError(f"{name}'s parameters must be numbers (iters a whole one), not {params!r}") from None
    if "fraction" in fields and not 0 <= param < 0.5:
        raise ValueError("trimmed_mean's fraction must be in [0, 0.5)")
    if "tau" in fields and not 0 < param < math.inf:
        raise ValueError("centered_clip's tau must be positive and finite")
    if not 1 <= iters <= 100:
        raise ValueError("centered_clip's iters must be 1 to 100")
    return Rule(name, param, iters)


def aggregate(tensors: list[torch.Tensor], weights: list[float] | None = None,
              rule: Rule | str = "mean") -> Aggregate:
    """Reduce ``tensors`` (one shape) with ``rule``; ``weights`` (non-negative,
    a positive sum; each :func:`bounded` by the median) apply to ``mean`` and
    below three contributions.  ValueError
    for no tensors, differing shapes or bad weights."""
    rule = parse_rule(rule) if isinstance(rule, str) else rule
    if not tensors:
        raise ValueError("nothing to aggregate")
    shape = tensors[0].shape
    if any(t.shape != shape for t in tensors):
        raise ValueError("contributions to aggregate differ in shape")
    k = len(tensors)
    if weights is not None and (len(weights) != k or min(weights) < 0 or sum(weights) <= 0):
        raise ValueError(f"weights are {k} non-negative numbers with a positive sum, not {weights!r}")
    rows = [t.detach().float().reshape(-1) for t in tensors]
    if rule.name == "mean" or k < 3:
        return Aggregate(_weighted_mean(rows, weights).view(shape), [])
    flat = torch.stack(rows)
    finite = torch.isfinite(flat).all(dim=1).tolist()
    dropped = [i for i in range(k) if not finite[i]]
    kept = [i for i in range(k) if finite[i]]
    if not kept:
        return Aggregate(torch.zeros(shape), dropped)
    if len(kept) < 3:
        value, clipped = _weighted_mean([flat[i] for i in kept], [weights[i] for i in kept] if weights else None), []
    elif rule.name == "trimmed_mean":
        value, clipped = _trimmed_mean(flat[kept], rule.param)
    else:
        value, clipped = _centered_clip(flat[kept], rule.param, rule.iters)
    return Aggregate(value.view(shape), sorted(dropped + [kept[i] for i in clipped]))


def aggregate_state(states: list[dict[str, torch.Tensor]], weights: list[float] | None = None,
                    rule: Rule | str = "mean") -> tuple[dict[str, torch.Tensor], list[int]]:
    """:func:`aggregate` over whole state dicts, each flattened to one vector
    (its tensors in name order), so clipping bounds a contribution's norm as a
    whole.  The result is float32 in the first state's shapes, with the
    clipped indices.  ValueError naming an entry some state lacks or holds
    with another shape."""
    if not states:
        raise ValueError("nothing to aggregate")
    names = sorted(states[0])
    for state in states:
        odd = sorted(set(names) ^ set(state))
        if odd:
            raise ValueError(f"{odd[0]!r}: not in every state")
        for name in names:
            if state[name].shape != states[0][name].shape:
                raise ValueError(f"{name!r}: shapes differ between states")
    result = aggregate([torch.cat([s[n].detach().float().reshape(-1) for n in names]) if names
                        else torch.zeros(0) for s in states], weights, rule)
    out, offset = {}, 0
    for name in names:
        shape = states[0][name].shape
        size = states[0][name].numel()
        out[name] = result.value[offset:offset + size].view(shape)
        offset += size
    return out, result.clipped


MAX_WEIGHT_RATIO = 4  # no contribution weighs more than this many times the median one


def bounded(weights: list[float]) -> list[float]:
    """``weights`` with each capped at :data:`MAX_WEIGHT_RATIO` × their (lower)
    median: weights are sample counts the contributors claim, and one claiming
    2**63 samples must not take the whole average."""
    cap = MAX_WEIGHT_RATIO * statistics.median_low(weights)
    return [min(w, cap) for w in weights] if cap > 0 else list(weights)


def _weighted_mean(rows: list[torch.Tensor], weights: list[float] | None) -> torch.Tensor:
    """Σ wᵢ·rowᵢ / Σ wᵢ, accumulated row by row in order (one output vector, no stacking)."""
    w = bounded(weights) if weights is not None else [1.0] * len(rows)
    total = float(sum(w))
    out = rows[0].mul(w[0] / total)
    for row, weight in zip(rows[1:], w[1:]):
        out.add_(row, alpha=weight / total)
    return out


def _trimmed_mean(flat: torch.Tensor, fraction: float | None) -> tuple[torch.Tensor, list[int]]:
    k = len(flat)
    trim = min(max(1, int((0.2 if fraction is None else fraction) * k)), (k - 1) // 2)
    ordered, order = flat.sort(dim=0, stable=True)
    value = ordered[trim:k - trim].mean(dim=0)
    kept = torch.zeros_like(flat, dtype=torch.bool).scatter_(0, order[trim:k - trim], True)
    trimmed = (~kept).sum(dim=1).tolist()
    return value, [i for i in range(k) if 2 * trimmed[i] > flat.shape[1]]


def _norms(rows: torch.Tensor) -> torch.Tensor:
    return fixed_sum(torch.square(rows)).sqrt()


def _centered_clip(flat: torch.Tensor, tau: float | None, iters: int) -> tuple[torch.Tensor, list[int]]:
    center = flat.median(dim=0).values
    if tau is None:
        tau = float(_norms(flat - center).median())
    scale = torch.ones(len(flat))
    for _ in range(iters):
        diff = flat - center
        scale = torch.clamp(tau / torch.clamp(_norms(diff), min=1e-12), max=1.0)
        center = center + (diff * scale[:, None]).mean(dim=0)
    return center, [i for i in range(len(flat)) if scale[i] < FAR_OUT]
