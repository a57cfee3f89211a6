"""DDM: decentralized diffusion models, routing among flow-matching experts.

Each expert is a flow-matching model trained on its own cluster of the data;
a small router gives, for each sample, logits over the K experts.  At every
sampling step the caller asks the experts the router picked for their
velocity, then combines them with the router's weights:

* :func:`route` turns logits into weights (``full`` softmax, ``top1``,
  ``topk``, ``uniform``); :func:`needed` lists the experts to call;
* :func:`combine` mixes the velocities of the experts that answered,
  renormalizing each sample's weights over them.

Flow matching here runs from noise to data: x0 ~ N(0, I) at t = 0, the data
x1 at t = 1, ``x_t = (1 - t)·x0 + t·x1``, and the velocity a model learns is
``x1 - x0``.  :func:`euler_times` and :func:`euler_step` are the pieces of an
Euler sampler; the loop itself is the caller's, which awaits remote experts
between steps.
"""

from __future__ import annotations

import math

import torch

MODES = ("full", "top1", "topk", "uniform")


def route(router_logits: torch.Tensor, mode: str, k: int = 2) -> torch.Tensor:
    """Weights over K experts for each of B samples (shape [B, K], each row
    summing to one, the logits' dtype): ``full`` is the softmax; ``top1`` the
    one-hot of the largest logit; ``topk`` the softmax over the ``k`` largest
    logits, zero elsewhere; ``uniform`` 1/K whatever the logits.  Ties go to
    the lower index.  A logit of -inf turns an expert off for that sample.
    ValueError for another shape or mode, NaN or +inf, a row of -inf only,
    or (for ``topk``) k not in 1..K."""
    if mode not in MODES:
        raise ValueError(f"routing mode must be one of {', '.join(MODES)}, not {mode!r}")
    x = router_logits
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point() or x.shape[1] < 1:
        raise ValueError("router logits are a floating-point tensor of shape [batch, experts], experts >= 1")
    if torch.isnan(x).any() or (x == math.inf).any():
        raise ValueError("router logits must be finite or -inf, not NaN or +inf")
    if x.shape[0] and (x == -math.inf).all(dim=1).any():
        raise ValueError("a row of router logits turns every expert off (all -inf)")
    batch, experts = x.shape
    if mode == "uniform":
        return torch.full_like(x, 1.0 / experts)
    if mode == "full":
        return torch.softmax(x, dim=1)
    if mode == "top1":
        k = 1
    elif isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= experts:
        raise ValueError(f"topk routing needs k from 1 to the number of experts ({experts}), not {k!r}")
    order = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :k]
    keep = torch.zeros_like(x, dtype=torch.bool).scatter_(1, order, True)
    return torch.softmax(x.masked_fill(~keep, -math.inf), dim=1)


def needed(weights: torch.Tensor) -> list[int]:
    """The experts to call: the sorted indices of the columns of ``weights``
    ([B, K]) with a nonzero weight in some row.  ValueError for another shape."""
    if not isinstance(weights, torch.Tensor) or weights.dim() != 2:
        raise ValueError("weights are a tensor of shape [batch, experts]")
    return torch.nonzero((weights != 0).any(dim=0)).flatten().tolist()


def combine(weights: torch.Tensor, outputs: dict[int, torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """``Σ_k w[b, k] · outputs[k][b]`` over the experts present in ``outputs``,
    each row's weights renormalized over them; a row whose weight is all on
    experts that did not answer takes the plain average of those that did
    (a velocity that is someone's guess beats none).  Outputs are [B, ...]
    (any trailing shape, the same for all; [B, D] for vectors).  Returns the
    combination, in the outputs' dtype, and the sorted experts that carry
    some weight in it.  ValueError for no outputs, an index outside 0..K-1,
    shapes that disagree, or weights that are negative, NaN or infinite."""
    if not isinstance(weights, torch.Tensor) or weights.dim() != 2 or not weights.is_floating_point():
        raise ValueError("weights are a floating-point tensor of shape [batch, experts]")
    if not torch.isfinite(weights).all() or (weights < 0).any():
        raise ValueError("weights must be finite and non-negative")
    if not outputs:
        raise ValueError("no expert's output to combine")
    batch, experts = weights.shape
    present = sorted(outputs)
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < experts for i in present):
        raise ValueError(f"outputs are keyed by expert index, 0 to {experts - 1}, not {present!r}")
    tensors = [outputs[i] for i in present]
    if any(not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != batch for t in tensors):
        raise ValueError(f"each expert's output is a tensor of shape [{batch}, ...]")
    if len({t.shape for t in tensors}) != 1:
        raise ValueError("the experts' outputs differ in shape")
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    w = weights[:, present].double()
    total = w.sum(dim=1, keepdim=True)
    w = torch.where(total > 0, w / total.clamp_min(torch.finfo(torch.float64).tiny),
                    torch.full_like(w, 1.0 / len(present)))
    stacked = torch.stack([t.to(dtype) for t in tensors], dim=1)  # [B, P, ...]
    shaped = w.to(dtype).reshape(batch, len(present), *([1] * (stacked.dim() - 2)))
    used = [present[j] for j in torch.nonzero((w != 0).any(dim=0)).flatten().tolist()]
    return (shaped * stacked).sum(dim=1), used


def _check_pair(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.shape != b.shape:
        raise ValueError(f"{what} are tensors of one shape")


def interpolate(x0: torch.Tensor, x1: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
    """The point ``(1 - t)·x0 + t·x1`` on the straight path from noise ``x0``
    to data ``x1`` (one shape, batch first).  ``t`` is a number or a tensor
    of one time per sample (shape [B]), each in [0, 1].  ValueError for
    shapes that disagree or a time outside [0, 1]."""
    _check_pair(x0, x1, "noise and data")
    if isinstance(t, torch.Tensor):
        if t.dim() == 1:
            if x0.dim() < 1 or t.shape[0] != x0.shape[0]:
                raise ValueError(f"a time per sample is a tensor of shape [{x0.shape[0] if x0.dim() else 1}]")
            t = t.reshape(-1, *([1] * (x0.dim() - 1)))
        elif t.dim() != 0:
            raise ValueError("the time is a number, a 0-d tensor or one time per sample")
        if not ((t >= 0) & (t <= 1)).all():
            raise ValueError("flow-matching times are in [0, 1]")
        t = t.to(x0.dtype)
    elif not 0 <= t <= 1:
        raise ValueError(f"flow-matching times are in [0, 1], not {t!r}")
    return (1 - t) * x0 + t * x1


def target_velocity(x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
    """The velocity of the straight path from ``x0`` to ``x1``, the same at every
    t: ``x1 - x0``.  ValueError for shapes that disagree."""
    _check_pair(x0, x1, "noise and data")
    return x1 - x0


def euler_times(steps: int) -> list[float]:
    """The time at the start of each of ``steps`` Euler steps of size 1/steps
    from 0 to 1: ``[0, 1/steps, ..., (steps-1)/steps]``.  ValueError for
    steps < 1."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"an Euler sampler takes one or more steps, not {steps!r}")
    return [i / steps for i in range(steps)]


def euler_step(x: torch.Tensor, v: torch.Tensor, dt: float) -> torch.Tensor:
    """One Euler step along velocity ``v``: ``x + dt·v``.  ValueError for
    shapes that disagree."""
    _check_pair(x, v, "a point and its velocity")
    return x + dt * v
