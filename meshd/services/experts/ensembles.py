"""Ensembles of remote experts: HDEE for language models, DDM for flow-matching models.

Both call the experts they need concurrently (each a :class:`RemoteExpert`:
the fastest server, hedged, retried), leave out an expert that does not
answer (its weight goes to the others, renormalized) and say in their
result which experts answered and why the others did not.  The mixing is
:mod:`experts.hdee` and :mod:`experts.ddm`.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch
import trio

from experts import ddm, hdee

from ...rpc import RpcError
from .remote import ExpertUnavailable, RemoteExpert

DIM_TIMEOUT = 5.0  # seconds DDMEnsemble.dim waits for the experts' info


@dataclass
class Scored:
    """A sequence scored by an HDEE ensemble."""

    logp: torch.Tensor  # [T-1]: the mixture's log-probability of each token after the first
    log_weights: torch.Tensor  # [E', T-1]: each answering expert's log posterior before each of them
    answered: list[str]  # the experts in the mixture, in log_weights' row order
    dropped: dict[str, str] = field(default_factory=dict)  # expert -> why it is not
    last: dict[str, torch.Tensor] = field(default_factory=dict)  # expert -> log-distribution of the next token [V]


@dataclass
class NextToken:
    """An HDEE ensemble's distribution of the next token, and who made it.

    Unpacks as the pair earlier versions returned: ``logp, scored = await
    ens.next_token_logprobs(ids)``."""

    logp: torch.Tensor  # [V]: the mixture's log-distribution of the token after the context
    scored: Scored  # the context as scored: who answered, each expert's log posterior
    weights: dict[str, float]  # each answering expert's weight in this mixture (its posterior)

    @property
    def answered(self) -> list[str]:
        """The experts in the mixture."""
        return self.scored.answered

    @property
    def dropped(self) -> dict[str, str]:
        """The experts left out, and why."""
        return self.scored.dropped

    def __iter__(self):
        return iter((self.logp, self.scored))


STRAGGLER_FACTOR = 4.0  # an expert still silent this many times the first answer's wait after the call ...
STRAGGLER_MIN = 1.0  # ... and at least this many seconds after it, is dropped from the step as slow


async def _gather(calls: dict[str, tuple[RemoteExpert, Callable[[], Awaitable]]]
                  ) -> tuple[dict[str, object], dict[str, str]]:
    """Await every call of ``calls[name] = (expert, call)`` concurrently: (answers
    by name, failures by name).

    Every expert's servers are looked up first (a lookup is cached for
    ``refresh_interval``), and only then does the clock start: an expert whose
    servers must first be found through the DHT is not a slow one.  The
    lookups get :data:`STRAGGLER_MIN` to end; one still looking then (nobody
    found yet: it looks for up to ``FIND_WAIT``) goes on while the calls are
    made, its call joining it.  Once the first answer from another node is in
    after w seconds (an expert this node serves answers in-process, at once,
    which says nothing of what the network takes), the others get until
    max(:data:`STRAGGLER_MIN`, :data:`STRAGGLER_FACTOR` × w) after the calls
    began; one still silent then is dropped as slow (its
    :class:`RemoteExpert` counts the failure and backs off from that server,
    so a dead expert costs the ensemble one wait, not one per step)."""
    answers: dict[str, object] = {}
    failures: dict[str, str] = {}
    first, left, looking, looked = trio.Event(), len(calls), len(calls), trio.Event()
    if not calls:
        return answers, failures

    async def find(expert: RemoteExpert) -> None:
        nonlocal looking
        await expert.servers()
        looking -= 1
        if not looking:
            looked.set()

    async def one(name: str, expert: RemoteExpert, call) -> None:
        nonlocal left
        try:
            answers[name] = await call()
            if not expert.served_here():
                first.set()
        except ExpertUnavailable as exc:
            failures[name] = str(exc)
        left -= 1
        if not left:
            nursery.cancel_scope.cancel()  # all in: the straggler watch is not needed

    async def watch() -> None:
        await first.wait()
        await trio.sleep_until(started + max(STRAGGLER_MIN, STRAGGLER_FACTOR * (trio.current_time() - started)))
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for expert, _ in calls.values():
            nursery.start_soon(find, expert)
        with trio.move_on_after(STRAGGLER_MIN):
            await looked.wait()
        started = trio.current_time()
        nursery.start_soon(watch)
        for name, (expert, call) in calls.items():
            nursery.start_soon(one, name, expert, call)
    for name in calls:
        if name not in answers and name not in failures:
            waited = trio.current_time() - started
            failures[name] = f"no answer by {waited:.1f} s, long after the others: dropped as slow"
    return answers, failures


class HDEEEnsemble:
    """Language-model experts (kind ``lm``) weighted by their posterior given the text so far.

    ``prior`` is ``"uniform"`` or a map from expert id to its prior
    probability (e.g. one :func:`experts.hdee.estimate_prior` made on held-out
    text); ``rule="uniform"`` averages the experts' probabilities instead.
    """

    def __init__(self, node, expert_ids: list[str], *, prior: str | dict[str, float] = "uniform",
                 rule: str = "posterior", timeout: float | None = None):
        if not expert_ids or len(set(expert_ids)) != len(expert_ids):
            raise ValueError("an ensemble needs distinct expert ids")
        if rule not in ("posterior", "uniform"):
            raise ValueError(f"rule must be posterior or uniform, not {rule!r}")
        if prior != "uniform" and (not isinstance(prior, dict) or set(prior) != set(expert_ids)
                                   or not all(p >= 0 for p in prior.values()) or sum(prior.values()) <= 0):
            raise ValueError("prior is 'uniform' or a probability for every expert of the ensemble")
        self.expert_ids, self.prior, self.rule = list(expert_ids), prior, rule
        self.experts = {e: RemoteExpert(node, e, op="score", timeout=timeout) for e in expert_ids}
        self.weights: dict[str, float] = {}  # each answering expert's posterior after the last text scored

    def _log_prior(self, names: list[str]) -> torch.Tensor | None:
        if self.prior == "uniform":
            return None
        return torch.tensor([math.log(self.prior[n]) if self.prior[n] > 0 else -math.inf for n in names],
                            dtype=torch.float64)

    async def score(self, ids: torch.Tensor) -> Scored:
        """The mixture's log-probability of each token of ``ids`` (int64 [T], T >= 2)
        after the first.  ExpertUnavailable if no expert answered."""
        if ids.dtype != torch.int64 or ids.dim() != 1 or ids.numel() < 2:
            raise ValueError("ids are one sequence of int64 token ids, at least 2")
        answers, dropped = await _gather({e: (x, lambda x=x: x(ids[None])) for e, x in self.experts.items()})
        answered = [e for e in self.expert_ids if e in answers]
        if not answered:
            raise ExpertUnavailable(f"no expert of the ensemble answered: {dropped}")
        logp = torch.cat([answers[e][0] for e in answered]).double()  # [E', T-1]
        prior = self._log_prior(answered)
        if self.prior != "uniform" and bool((prior == -math.inf).all()):
            raise ExpertUnavailable("the experts that answered all have prior zero")
        if self.rule == "uniform":
            mix, log_w = hdee.uniform_mixture(logp), torch.full_like(logp, -math.log(len(answered)))
        else:
            mix, log_w = hdee.posterior_mixture(logp, prior)
        final = torch.log_softmax(log_w[:, -1] + logp[:, -1], dim=0) if self.rule == "posterior" else log_w[:, -1]
        self.weights = dict(zip(answered, final.exp().tolist()))
        return Scored(mix.float(), log_w.float(), answered, dropped,
                      {e: answers[e][1][0] for e in answered})

    async def estimate_prior(self, sequences: list[torch.Tensor]) -> dict[str, float]:
        """HDEE's cached prior: score each held-out sequence (int64 [T]) with the ensemble,
        take the posterior each ended with (an expert that did not answer one has weight 0
        there), average over the sequences (:func:`experts.hdee.estimate_prior`), and use
        that as this ensemble's prior from now on.  Returns it (probabilities by expert)."""
        if not sequences:
            raise ValueError("estimating a prior needs held-out sequences")
        saved, self.prior = self.prior, "uniform"  # each sequence's posterior, from a uniform start
        finals = []
        try:
            for ids in sequences:
                await self.score(ids)
                finals.append([math.log(self.weights[e]) if self.weights.get(e, 0) > 0 else -math.inf
                               for e in self.expert_ids])
        finally:
            self.prior = saved
        log_prior = hdee.estimate_prior(torch.tensor(finals, dtype=torch.float64))
        self.prior = dict(zip(self.expert_ids, log_prior.exp().tolist()))
        return self.prior

    async def next_token_logprobs(self, context: torch.Tensor) -> NextToken:
        """The mixture's log-distribution of the token after ``context`` (int64 [T],
        T >= 2), each expert weighted by its posterior after the whole context
        (``.logp``, [V]), with who answered (``.answered``, ``.dropped``) and their
        weights (``.weights``); it unpacks as ``logp, scored``."""
        scored = await self.score(context)
        weights = dict(self.weights)
        log_w = torch.tensor([math.log(max(weights[e], 1e-300)) for e in scored.answered], dtype=torch.float64)
        last = torch.stack([scored.last[e].double() for e in scored.answered])  # [E', V]
        return NextToken(torch.logsumexp(log_w[:, None] + last, dim=0).float(), scored, weights)


@dataclass
class Sampled:
    """What a DDM ensemble's sampling did."""

    x: torch.Tensor  # [n, D] the samples
    rows: dict[str, int]  # expert -> rows it evaluated (a row is one sample at one step)
    calls: dict[str, int]  # expert -> calls made to it
    dropped: dict[str, str] = field(default_factory=dict)  # expert -> why it was last left out of a step


class DDMEnsemble:
    """Flow-matching experts (kind ``flow``: ``v(x, t)``) combined by a router
    (kind ``router``: logits over the experts given ``(x, t)``) at every
    sampling step: ``mode`` full (router-weighted sum), ``top1``, ``topk``
    (``top_k`` experts per sample) or ``uniform`` (no router).  Without
    ``mode``, ``top_k`` chooses (1: ``top1``, more: ``topk``), and with
    neither it is ``full`` (``uniform`` without a router).  Each expert is
    sent only the samples it carries weight for; an expert that fails (or is
    far slower than the others) is left out of that step and its samples
    re-routed among the others in the same step; the next step asks it again
    (a dead one's :class:`RemoteExpert` then fails at once while it backs off)."""

    def __init__(self, node, experts: list[str], router: str | None = None, *, mode: str | None = None,
                 top_k: int | None = None, timeout: float | None = None):
        if mode is None:
            mode = ("uniform" if router is None else "full") if top_k is None else "top1" if top_k == 1 else "topk"
        if mode not in ddm.MODES:
            raise ValueError(f"mode must be one of {', '.join(ddm.MODES)}, not {mode!r}")
        if mode != "uniform" and router is None:
            raise ValueError(f"mode {mode} needs a router")
        if not experts or len(set(experts)) != len(experts):
            raise ValueError("an ensemble needs distinct expert ids")
        top_k = 2 if top_k is None else top_k
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k is a positive number of experts, not {top_k!r}")
        self.expert_ids, self.mode, self.top_k = list(experts), mode, top_k
        self.experts = [RemoteExpert(node, e, timeout=timeout) for e in experts]
        self.router = RemoteExpert(node, router, timeout=timeout) if mode != "uniform" else None
        self._service = node.service("experts")
        self._dim: int | None = None

    async def velocity(self, x: torch.Tensor, t: float, sampled: Sampled) -> torch.Tensor:
        """The ensemble's velocity at ``x`` ([B, D]) and time ``t``; counts calls in ``sampled``."""
        batch, k = x.shape[0], len(self.experts)
        times = torch.full((batch,), float(t))
        logits = (await self.router(x, times)).double() if self.router is not None else torch.zeros(batch, k)
        if logits.shape != (batch, k):
            raise ValueError(f"the router gave logits of shape {list(logits.shape)}, not [{batch}, {k}]")
        mode = "full" if self.mode == "uniform" else self.mode  # uniform: equal logits, full softmax over the live
        outputs: dict[int, torch.Tensor] = {}
        dead: dict[int, str] = {}  # experts out of this step (a dead one's RemoteExpert then fails fast, backing off)
        done = {i: torch.zeros(batch, dtype=torch.bool) for i in range(k)}
        weights = None
        for _ in range(k + 1):  # each pass that asks again has lost an expert: k + 1 passes settle it
            if len(dead) == k:
                raise ExpertUnavailable(f"every expert failed: {dead}")
            masked = logits.clone()
            masked[:, list(dead)] = -math.inf
            weights = ddm.route(masked, mode, min(self.top_k, k - len(dead)))
            todo = {i: (weights[:, i] > 0) & ~done[i] for i in range(k) if i not in dead}
            todo = {i: rows for i, rows in todo.items() if rows.any()}
            if not todo:
                break
            answers, failures = await _gather({
                i: (self.experts[i], lambda i=i, rows=rows: self.experts[i](x[rows], times[rows]))
                for i, rows in todo.items()})
            for i, rows in todo.items():
                name = self.expert_ids[i]
                sampled.calls[name] = sampled.calls.get(name, 0) + 1
                if i in failures:
                    dead[i] = sampled.dropped[name] = failures[i]
                    continue
                sampled.rows[name] = sampled.rows.get(name, 0) + int(rows.sum())
                out = outputs.setdefault(i, torch.zeros_like(x))
                out[rows] = answers[i].to(x.dtype)
                done[i] |= rows
        return ddm.combine(weights, {i: o for i, o in outputs.items() if i not in dead})[0]

    async def dim(self) -> int:
        """The size of the vectors the experts take, as their servers' info says
        (``serve(..., dim=)``, or the module's ``dim``), asked of every expert's and
        the router's servers at once, then kept.  ValueError if none says, or two
        disagree."""
        if self._dim is not None:
            return self._dim
        said: dict[str, int] = {}

        async def ask(expert: RemoteExpert) -> None:
            with trio.move_on_after(DIM_TIMEOUT):
                for peer in (await expert.servers())[:2]:
                    try:
                        info = await self._service.info(peer, expert.expert_id, timeout=DIM_TIMEOUT)
                    except (RpcError, trio.TooSlowError, OSError):
                        continue
                    if type(info.get("dim")) is int and info["dim"] > 0:
                        said[expert.expert_id] = info["dim"]
                        return

        async with trio.open_nursery() as nursery:
            for expert in [*self.experts, *([self.router] if self.router is not None else [])]:
                nursery.start_soon(ask, expert)
        if not said:
            raise ValueError("no expert's info says its dim (serve them with dim=, or pass sample(dim=))")
        if len(set(said.values())) > 1:
            raise ValueError(f"the experts disagree on dim: {said}")
        self._dim = next(iter(said.values()))
        return self._dim

    async def sample(self, n: int, dim: int | None = None, *, steps: int = 100, seed: int = 0) -> Sampled:
        """``n`` samples: Euler from noise (t = 0) to data (t = 1) in ``steps`` steps;
        ``dim`` (the vectors' size) defaults to what the experts say (:meth:`dim`)."""
        if dim is None:
            dim = await self.dim()
        x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
        sampled = Sampled(x, {}, {})
        for t in ddm.euler_times(steps):
            x = ddm.euler_step(x, await self.velocity(x, t, sampled), 1.0 / steps)
        sampled.x = x
        return sampled
