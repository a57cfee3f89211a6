"""Training the pieces of an expert ensemble on one machine (torch, no network).

* :func:`kmeans`: split data into clusters (DDM trains one expert per cluster);
* :func:`train_flow`: a flow-matching expert on its cluster's data;
* :func:`train_router`: the DDM router r(k | x_t, t) on every cluster's data;
* :func:`fit`: the AdamW loop they share, for any other loss.

Deterministic given their seeds; the mesh side (publishing, serving) is in
``meshd.experts``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .ddm import interpolate, target_velocity


def _nearest(x: torch.Tensor, centres: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's nearest centre (ties to the lowest index) and its squared distance."""
    idx, d2 = [], []
    for at in range(0, len(x), chunk):
        d = torch.cdist(x[at:at + chunk], centres).square()
        best = d.min(1)
        idx.append(best.indices)
        d2.append(best.values)
    return torch.cat(idx), torch.cat(d2)


def kmeans(x: torch.Tensor, k: int, seed: int, iters: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    """k-means of the rows of ``x`` [N, D]: (assignments [N], centres [k, D]).

    k-means++ initialisation from a generator seeded with ``seed``, then up to
    ``iters`` Lloyd iterations, stopping early once no assignment changes.  A
    cluster left empty keeps its previous centre.  The returned assignments
    are each row's nearest returned centre."""
    if x.dim() != 2 or not 0 < k <= len(x):
        raise ValueError(f"need 0 < k <= N rows of a 2-D tensor, not k={k} for shape {tuple(x.shape)}")
    x = x.float()
    gen = torch.Generator().manual_seed(seed)
    centres = x[torch.randint(len(x), (1,), generator=gen)]
    d2 = _nearest(x, centres)[1]
    for _ in range(1, k):
        if float(d2.sum()) > 0:
            pick = torch.multinomial(d2.double(), 1, generator=gen)
        else:  # every point sits on a centre already
            pick = torch.randint(len(x), (1,), generator=gen)
        centres = torch.cat([centres, x[pick]])
        d2 = torch.minimum(d2, (x - x[pick]).square().sum(1))
    assign = None
    for _ in range(iters):
        new = _nearest(x, centres)[0]
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        sums = torch.zeros_like(centres).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k)
        full = counts > 0
        centres = centres.clone()
        centres[full] = sums[full] / counts[full, None]
    return _nearest(x, centres)[0], centres


def _flow_batch(data: torch.Tensor, batch: int, gen: torch.Generator):
    idx = torch.randint(len(data), (batch,), generator=gen)
    x1 = data[idx]
    x0 = torch.randn(x1.shape, generator=gen)
    t = torch.rand(batch, generator=gen)
    return idx, x0, x1, t


def fit(model: torch.nn.Module, steps: int, lr: float, seed: int,
        loss: Callable[[torch.Generator], torch.Tensor], *, clip: float | None = None,
        decay: float = 0.0) -> list[float]:
    """``steps`` AdamW steps (a new optimizer) on ``loss(generator)``, its batches drawn
    from a generator seeded with ``seed``, ``model`` in training mode, gradients
    clipped to norm ``clip`` if given; the per-step losses.

    The learning rate is ``lr`` throughout, or with ``decay`` in (0, 1] held at ``lr``
    and then brought down linearly to zero over the last ``decay`` of the steps
    (step i of n runs at lr · min(1, (n − i) / (decay · n))): the last iterate of a
    constant rate still wanders with the batches' noise, and small flow-matching
    models sit on a plateau for their first few hundred steps, which a schedule that
    decays from the start (cosine) can end before they leave it."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay is the fraction of the steps the learning rate falls over, 0 to 1, not {decay}")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr)
    losses = []
    model.train()
    for i in range(steps):
        if decay:
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (steps - i) / (decay * steps))
        value = loss(gen)
        opt.zero_grad(set_to_none=True)
        value.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(value.item())
    return losses


def train_flow(model: torch.nn.Module, data: torch.Tensor, steps: int, *, batch: int = 256, lr: float = 2e-3,
               seed: int = 0, decay: float = 0.0) -> list[float]:
    """Trains velocity ``model`` in place on ``data`` [N, D]; the per-step losses.

    Each step: ``batch`` rows x1 of ``data``, noise x0 ~ N(0, I), t ~ U[0, 1),
    all from a generator seeded with ``seed``; loss = mean squared error of
    model(x_t, t) against x1 − x0; one AdamW step (the rate decayed as :func:`fit` says)."""
    def loss(gen: torch.Generator) -> torch.Tensor:
        _, x0, x1, t = _flow_batch(data, batch, gen)
        return F.mse_loss(model(interpolate(x0, x1, t), t), target_velocity(x0, x1))

    return fit(model, steps, lr, seed, loss, decay=decay)


def train_router(router: torch.nn.Module, data: torch.Tensor, clusters: torch.Tensor, steps: int, *,
                 batch: int = 256, lr: float = 2e-3, seed: int = 0, decay: float = 0.0) -> list[float]:
    """Trains ``router`` in place to predict ``clusters[i]`` (the cluster of the clean point data[i])
    from (x_t, t) on the same noisy paths as :func:`train_flow`; the per-step cross-entropies."""
    if len(clusters) != len(data):
        raise ValueError(f"{len(clusters)} cluster labels for {len(data)} rows")

    def loss(gen: torch.Generator) -> torch.Tensor:
        idx, x0, x1, t = _flow_batch(data, batch, gen)
        return F.cross_entropy(router(interpolate(x0, x1, t), t), clusters[idx])

    return fit(router, steps, lr, seed, loss, decay=decay)
