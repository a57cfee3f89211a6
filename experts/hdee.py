"""HDEE: mixing heterogeneous domain experts by their posterior given the text so far.

Each expert e is a language model trained on its own domain.  Before token t
the ensemble weighs e by the posterior that e is the right expert for this
text, given the tokens already seen:

    w[e, t] ∝ prior[e] · ∏_{s<t} p_e(x_s | x_<s)

and predicts token t with the mixture Σ_e w[e, t] · p_e(x_t | x_<t).  The
product of the mixture's predictions is then the marginal likelihood of the
text under the prior, so the mixture is never much worse than the best expert
in hindsight (at most -log prior[e] nats over the whole text).

* :func:`posterior_mixture` does a whole sequence at once (scoring, training
  the cached prior);
* :class:`Posterior` does it block by block while decoding over named
  experts, some of which may not answer a block;
* :func:`uniform_mixture` is the baseline, plain averaging of probabilities;
* :func:`estimate_prior` is the "cached prior": the mean final posterior over
  held-out sequences, to start the next sequence from.

Everything is in natural-log probabilities.  Sums of log-probabilities are
taken in float64 and the results are returned in the inputs' dtype.  A
log-probability of -inf (an expert that gave an observed token probability
zero) rules that expert out from then on; NaN and +inf are refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def _check_logp(logp: torch.Tensor) -> None:
    if not isinstance(logp, torch.Tensor) or logp.dim() != 2 or not logp.is_floating_point():
        raise ValueError("logp is a floating-point tensor of shape [experts, positions]")
    if logp.shape[0] < 1:
        raise ValueError("logp needs at least one expert (its first dimension)")
    if torch.isnan(logp).any() or (logp == math.inf).any():
        raise ValueError("logp holds log-probabilities: no NaN and no +inf (-inf is probability zero)")


def _check_prior(log_prior: torch.Tensor, experts: int) -> None:
    if not isinstance(log_prior, torch.Tensor) or log_prior.shape != (experts,):
        raise ValueError(f"the log prior is a tensor of shape [{experts}], one entry per expert")
    if torch.isnan(log_prior).any() or (log_prior == math.inf).any():
        raise ValueError("the log prior must be finite or -inf (an expert turned off), not NaN or +inf")
    if (log_prior == -math.inf).all():
        raise ValueError("the log prior turns every expert off (all -inf)")


def _normalize(scores: torch.Tensor, dim: int) -> torch.Tensor:
    """``scores`` minus their logsumexp along ``dim``; -inf everywhere along
    ``dim`` where every score is -inf (where log_softmax would give NaN)."""
    total = torch.logsumexp(scores, dim=dim, keepdim=True)
    return torch.where(torch.isfinite(total), scores - total, torch.full_like(scores, -math.inf))


def posterior_mixture(logp: torch.Tensor, log_prior: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The posterior-weighted mixture of E experts over one sequence of T tokens.

    ``logp[e, t]`` is expert e's log-probability of token t given the tokens
    before it; ``log_prior`` (shape [E], normalized here, -inf turns an expert
    off; uniform if None) is the weight before the first token.  Returns
    ``(mix, log_w)``: ``log_w[e, t]`` is the log posterior of e before token t
    (``log_w[:, 0]`` is the normalized prior), each column a log-distribution,
    and ``mix[t] = logsumexp_e(log_w[e, t] + logp[e, t])``.  From a position
    where every expert still in play has given a seen token probability zero,
    ``mix`` and ``log_w`` are -inf.  ValueError for shapes other than [E, T]
    and [E], NaN or +inf, or a prior that is -inf everywhere.
    """
    _check_logp(logp)
    experts, positions = logp.shape
    if log_prior is None:
        prior = torch.full((experts,), -math.log(experts), dtype=torch.float64)
    else:
        _check_prior(log_prior, experts)
        prior = torch.log_softmax(log_prior.double(), dim=0)
    lp = logp.double()
    # Σ_{s<t} logp[e, s]: zero before the first token, then the running sum.
    seen = torch.cat([torch.zeros(experts, 1, dtype=torch.float64), torch.cumsum(lp, dim=1)], dim=1)
    seen = seen[:, :positions]
    log_w = _normalize(prior[:, None] + seen, dim=0)
    mix = torch.logsumexp(log_w + lp, dim=0)
    return mix.to(logp.dtype), log_w.to(logp.dtype)


def uniform_mixture(logp: torch.Tensor) -> torch.Tensor:
    """The plain average of the E experts' probabilities at each of T positions,
    as log-probabilities: ``logsumexp_e(logp[e, t]) - log E``.  ValueError as
    :func:`posterior_mixture`."""
    _check_logp(logp)
    mix = torch.logsumexp(logp.double(), dim=0) - math.log(logp.shape[0])
    return mix.to(logp.dtype)


def estimate_prior(final_log_weights: torch.Tensor) -> torch.Tensor:
    """The cached prior: the log of the mean, over N held-out sequences, of the
    posterior weights each ended with (``final_log_weights`` [N, E]; each row is
    normalized first, so unnormalized log scores do as well).  The result sums
    to one in probability; an expert that no sequence gave weight gets -inf.
    ValueError for another shape, NaN or +inf, or a row that is -inf everywhere.
    """
    w = final_log_weights
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError("final_log_weights is a floating-point tensor of shape [sequences, experts]")
    if w.shape[0] < 1 or w.shape[1] < 1:
        raise ValueError("estimating a prior needs at least one sequence and one expert")
    if torch.isnan(w).any() or (w == math.inf).any():
        raise ValueError("final_log_weights holds log-weights: no NaN and no +inf")
    if (w == -math.inf).all(dim=1).any():
        raise ValueError("a sequence's final log-weights are -inf for every expert")
    rows = torch.log_softmax(w.double(), dim=1)
    mean = torch.logsumexp(rows, dim=0) - math.log(w.shape[0])
    return torch.log_softmax(mean, dim=0).to(w.dtype)  # exactly normalized despite rounding


class Posterior:
    """The posterior over named experts, carried from block to block while decoding.

    Each :meth:`mix` takes the log-probabilities that the experts that
    answered gave one block of tokens (the tokens the caller then keeps) and
    returns the mixture for that block, the weights moving position by
    position inside it exactly as in :func:`posterior_mixture`; after it the
    posterior includes the block.

    An expert that did not answer a block is neither rewarded nor punished for
    it: its posterior weight stays what it was, and the experts that answered
    share the rest in proportion to how well they predicted the block.  This
    is the same as charging the silent expert the mixture's own likelihood of
    the block.  (Keeping its log-likelihood unchanged instead would reward
    silence: every answering expert loses a few nats per token, so a silent
    expert's relative weight would grow by e^(that many nats) and one missed
    block would hand it the ensemble.)  If every expert that answered gives
    some token of a block probability zero, they are all ruled out and the
    silent ones share the whole weight; with no silent one the posterior is
    zero everywhere and further :meth:`mix` calls are ValueErrors.
    """

    def __init__(self, experts: list[str], log_prior: dict[str, float] | None = None):
        """``experts``: distinct names, at least one.  ``log_prior`` (normalized
        here, uniform if None) names every expert, -inf to turn one off.
        ValueError otherwise."""
        experts = list(experts)
        if not experts or len(set(experts)) != len(experts):
            raise ValueError("a posterior needs one or more experts with distinct names")
        self.experts = experts
        self._index = {name: i for i, name in enumerate(experts)}
        if log_prior is None:
            prior = torch.zeros(len(experts), dtype=torch.float64)
        else:
            if set(log_prior) != set(experts):
                raise ValueError("the log prior names every expert, and only those")
            prior = torch.tensor([float(log_prior[e]) for e in experts], dtype=torch.float64)
            _check_prior(prior, len(experts))
        self._log_w = torch.log_softmax(prior, dim=0)  # float64, normalized after every block
        self.answered_last: list[str] = []

    @property
    def log_weights(self) -> dict[str, float]:
        """Each expert's log posterior weight now (a log-distribution over all
        experts, unless every one has been ruled out)."""
        return dict(zip(self.experts, self._log_w.tolist()))

    def _subset(self, answered: Iterable[str] | None) -> list[int]:
        if answered is None:
            return list(range(len(self.experts)))
        names = set(answered)
        unknown = names - set(self.experts)
        if unknown:
            raise ValueError(f"not experts of this posterior: {sorted(map(str, unknown))}")
        if not names:
            raise ValueError("no expert answered")
        return sorted(self._index[n] for n in names)

    def weights(self, answered: Iterable[str] | None = None) -> dict[str, float]:
        """The posterior probabilities of the ``answered`` experts (all if None),
        renormalized over them, in the order of :attr:`experts`.  ValueError if
        none answered, for a name that is not an expert, or if every one of
        them has weight zero."""
        idx = self._subset(answered)
        sub = self._log_w[idx]
        if (sub == -math.inf).all():
            raise ValueError("every expert that answered has posterior weight zero")
        probs = torch.softmax(sub, dim=0).tolist()
        return {self.experts[i]: p for i, p in zip(idx, probs)}

    def mix(self, logp: dict[str, torch.Tensor]) -> torch.Tensor:
        """The mixture's log-probabilities for one block of T tokens, given
        ``logp[name]`` (shape [T]) from each expert that answered; the weights
        are renormalized over those, then move with each token as in
        :func:`posterior_mixture`, and the posterior afterwards includes the
        block (see the class for the experts that did not answer).  Returned
        in the inputs' (promoted) dtype.  ValueError for no experts, unknown
        names, tensors that are not one-dimensional or differ in length,
        NaN or +inf, or if every expert that answered has weight zero; then
        nothing changes."""
        if not logp:
            raise ValueError("no expert answered this block")
        idx = self._subset(logp)
        tensors = [logp[self.experts[i]] for i in idx]
        if any(not isinstance(t, torch.Tensor) or t.dim() != 1 or not t.is_floating_point()
               for t in tensors):
            raise ValueError("each expert's log-probabilities are a one-dimensional floating-point tensor")
        if len({t.shape[0] for t in tensors}) != 1:
            raise ValueError("the experts' log-probabilities for one block differ in length")
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        block = torch.stack([t.double() for t in tensors])
        _check_logp(block)
        prior = self._log_w[idx]
        if (prior == -math.inf).all():
            raise ValueError("every expert that answered has posterior weight zero")
        mix, _ = posterior_mixture(block, prior)
        # Inside the answering set: the posterior after the block's last token.
        after = _normalize(torch.log_softmax(prior, dim=0) + block.sum(dim=1), dim=0)
        log_w = self._log_w.clone()
        if torch.isfinite(torch.logsumexp(after, dim=0)):
            log_w[idx] = torch.logsumexp(prior, dim=0) + after  # same total mass, shared anew
        else:
            log_w[idx] = -math.inf  # all ruled out: the silent experts take the whole weight
        self._log_w = _normalize(log_w, dim=0)
        self.answered_last = [self.experts[i] for i in idx]
        return mix.to(dtype)
