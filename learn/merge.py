"""Gossip merge rules, applied tensor by tensor to state dicts.

* ``mean``: the (optionally sample-weighted) mean of own and received;
* ``variance_corrected``: that mean, rescaled to the received tensors' mean
  variance v*: W = (m − mean(m))·sqrt((v* + 1e-4) / (var(m) + 1e-4)) + mean(m).
  Averaging independently initialized models shrinks each tensor's variance
  and stalls learning ("vanishing variance"); this undoes the shrinking;
* ``conservative(c)``: m = c·own + (1−c)·mean(received), corrected as above
  with v* = c·var(own) + (1−c)·mean var(received).

Variances are population variances over all of a tensor's elements, summed
in a fixed order (:func:`learn.tensors.fixed_sum`); the math is float32 and
cast back to each tensor's dtype.
"""

from __future__ import annotations

import torch

from .tensors import fixed_sum

_EPS = 1e-4
_LOCAL = ("running_mean", "running_var", "num_batches_tracked")


class MergeError(ValueError):
    """Received state dicts do not match our own."""


def mergeable(name: str, tensor: torch.Tensor) -> bool:
    """Whether gossip merges this entry: not BatchNorm statistics, not a
    one-element tensor, only floating tensors."""
    return tensor.is_floating_point() and tensor.numel() > 1 and not name.endswith(_LOCAL)


def _average(t: torch.Tensor) -> torch.Tensor:
    return fixed_sum(t.reshape(-1)) / max(1, t.numel())


def _var(t: torch.Tensor) -> torch.Tensor:
    return _average(torch.square(t - _average(t)))


def _mean(tensors: list[torch.Tensor], weights: list[float] | None) -> torch.Tensor:
    if weights is None:
        return torch.stack(tensors).mean(dim=0)
    w = torch.tensor(weights, dtype=torch.float32)
    return (torch.stack(tensors) * (w / w.sum()).view(-1, *([1] * tensors[0].dim()))).sum(dim=0)


def _rescale(m: torch.Tensor, target_var: torch.Tensor) -> torch.Tensor:
    center = _average(m)
    return (m - center) * torch.sqrt((target_var + _EPS) / (_var(m) + _EPS)) + center


def _check(received: list, weights: list[float] | None = None) -> None:
    if not received:
        raise ValueError("nothing received to merge with")
    if weights is not None and (len(weights) != len(received) + 1 or min(weights) < 0 or sum(weights) <= 0):
        raise ValueError(f"weights are {len(received) + 1} non-negative sample counts (own first) "
                         f"with a positive sum, not {weights!r}")


def mean(own: torch.Tensor, received: list[torch.Tensor], weights: list[float] | None = None) -> torch.Tensor:
    """The mean of ``own`` and ``received`` (``weights``: sample counts, own first)."""
    _check(received, weights)
    return _mean([own.float(), *(r.float() for r in received)], weights)


def variance_corrected(own: torch.Tensor, received: list[torch.Tensor],
                       weights: list[float] | None = None) -> torch.Tensor:
    """:func:`mean`, rescaled to the mean variance of ``received`` (exactly so
    when the variances are large next to 1e-4)."""
    m = mean(own, received, weights)
    return _rescale(m, torch.stack([_var(r.float()) for r in received]).mean())


def conservative(own: torch.Tensor, received: list[torch.Tensor], c: float = 0.5) -> torch.Tensor:
    """``c`` of ``own`` and ``1 − c`` of the received mean, variance-corrected likewise."""
    _check(received)
    if not 0 <= c <= 1:
        raise ValueError(f"c is a share from 0 to 1, not {c!r}")
    own = own.float()
    others = [r.float() for r in received]
    m = c * own + (1 - c) * _mean(others, None)
    target = c * _var(own) + (1 - c) * torch.stack([_var(r) for r in others]).mean()
    return _rescale(m, target)


def merge_state(own: dict[str, torch.Tensor], received: list[dict[str, torch.Tensor]], rule: str,
                weights: list[float] | None = None, c: float = 0.5) -> dict[str, torch.Tensor]:
    """A new state dict: each mergeable entry merged with ``rule``, the rest
    copies of own's.  MergeError naming the entry if a received state lacks a
    mergeable entry or holds it with another shape or not as floats (any
    float dtype will do: quantized codecs decode to float32); ValueError for
    an unknown rule, bad weights or c."""
    if rule not in ("mean", "variance_corrected", "conservative"):
        raise ValueError(f"unknown merge rule {rule!r} (known: mean, variance_corrected, conservative)")
    if received:
        _check(received, weights)
    merged = {}
    for name, tensor in own.items():
        if not mergeable(name, tensor) or not received:
            merged[name] = tensor.clone()
            continue
        others = []
        for state in received:
            other = state.get(name)
            if other is None or other.shape != tensor.shape or not other.is_floating_point():
                raise MergeError(f"{name}: a received state lacks it or holds it with another shape "
                                 f"or not as floats")
            others.append(other)
        if rule == "mean":
            value = mean(tensor, others, weights)
        elif rule == "variance_corrected":
            value = variance_corrected(tensor, others, weights)
        else:
            value = conservative(tensor, others, c)
        merged[name] = value.to(tensor.dtype)
    return merged
