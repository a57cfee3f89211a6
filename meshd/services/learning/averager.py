"""Gossip averaging: each round, pull d random live partners' parameters and merge.

Every member keeps its own model; a round offers this member's parameters,
pulls ``partners`` others' (a slow or dead one is skipped at the round's
timeout) and merges them tensor by tensor with one of :mod:`learn.merge`'s
rules (``mean``, ``variance_corrected``, ``conservative``).  BatchNorm
running statistics and one-element tensors stay as they are.
"""

from __future__ import annotations

import logging
import random
import time
import torch
import trio

from learn.compress import decode, encode
from learn.gossip import GossipRound
from learn.merge import mergeable, merge_state
from learn.reports import GossipReport

from ...identity import PeerId
from ...rpc import RpcError

log = logging.getLogger("meshd.learning")

RULES = ("mean", "variance_corrected", "conservative")


class GossipAverager:
    """Gossip learning for ``model`` in group ``group`` of the node's learning service.

    ``await step(samples)`` runs one round; call it after the local epochs of
    a round.  ``rule`` merges (``conservative`` keeps ``c`` of the own model);
    ``compression`` (none, fp16, bf16, int8, int4) applies to what partners pull.
    """

    def __init__(self, node, model: torch.nn.Module, *, group: str, rule: str = "variance_corrected",
                 partners: int = 4, c: float = 0.5, compression: str = "none", block: int = 64,
                 weighted: bool = False, seed: int | None = None):
        if rule not in RULES:
            raise ValueError(f"rule must be one of {', '.join(RULES)}, not {rule!r}")
        self._service = node.service("learning")  # the Learning service, or a daemon session's view of it
        self.model = model
        self.rule, self.partners, self.c, self.weighted = rule, partners, c, weighted
        self.compression, self.block = compression, block
        self.group = self._service.join(group, algorithm="gossip", rule=rule)
        self.membership = self._service.membership(group)  # where samples and role are reported
        self._rng = random.Random(seed)

    def _named(self) -> list:
        state = self.model.state_dict()  # copied to the host: partners pull it while training goes on
        return [(name, encode(t.detach().to("cpu", copy=True), self.compression if mergeable(name, t) else "none",
                              self.block))
                for name, t in sorted(state.items())]

    async def step(self, samples: int = 0) -> GossipReport:
        """Offer this model, pull up to ``partners`` live members' and merge them in."""
        group = self.group
        started, wall = trio.current_time(), time.perf_counter()
        group.offer("params", group.round, self._named(), samples)
        before = sum(group.bytes_in.values())
        round_ = GossipRound(group.me, group.live(), self.partners, self._rng, started, group.clock.timeout())
        received: dict[bytes, tuple[dict, int]] = {}

        async def pull(peer: bytes) -> None:
            try:
                contribution, named = await group.pull(PeerId(peer), "params", timeout=group.clock.timeout())
                received[peer] = ({name: decode(enc) for name, enc in named}, contribution.samples)
                round_.received(peer, received[peer], trio.current_time())
            except (RpcError, trio.TooSlowError, OSError) as exc:
                log.debug("%s: no parameters from %s: %s", group.tag, PeerId(peer).short(), exc)
                round_.failed(peer)

        async with trio.open_nursery() as nursery:
            for peer in round_.partners:
                nursery.start_soon(pull, peer)
        states = [state for state, _ in round_.result()]
        if states:
            own = {name: t.detach().cpu() for name, t in self.model.state_dict().items()}  # merged on the host
            weights = [max(1, samples)] + [max(1, n) for _, n in round_.result()] if self.weighted else None
            merged = merge_state(own, states, self.rule, weights=weights, c=self.c)
            self.model.load_state_dict(merged)
        group.round += 1
        group.clock.observe(trio.current_time() - started)
        self.membership.report(samples=samples, role="contributor")  # it offered its parameters
        return GossipReport(group.round, len(round_.partners), len(states),
                            sum(group.bytes_in.values()) - before, time.perf_counter() - wall)
