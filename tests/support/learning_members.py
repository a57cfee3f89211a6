"""DiLoCo members for node and daemon tests: a training loop that records every outer round.

:class:`Trainer` runs one member's inner steps (a tiny model on random
batches) until it is cancelled or has taken its steps, and after every outer
round records the state hash the member published for it.  Every record sets
the :class:`Progress` the trainers share, so a test waits on a condition
over their records (bounded by a timeout) rather than sleeping.
:func:`check_caught_up` is what "a restarted member caught up" means, for
the in-process restart (tests/node) and the SIGKILLed process
(tests/daemon, whose member is ``diloco_member.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import trio

import meshd
from meshd.services.learning import LearningSection

GROUP = "run42"
INNER_STEPS = 4


def fast_config(**learning) -> meshd.Config:
    """A node config whose groups greet every 0.2 s and time rounds out after 2 s at the least."""
    config = meshd.Config()
    config.learning = LearningSection(**{"heartbeat_interval": 0.2, "discover_interval": 0.5,
                                         "round_timeout_min": 2.0, **learning})
    return config


def tiny_model(seed: int, *, layers: int = 2, width: int = 16, bias: bool = True) -> torch.nn.Module:
    """``layers`` Linear(width, width) with ReLUs between, initialised from ``seed``."""
    torch.manual_seed(seed)
    modules: list[torch.nn.Module] = []
    for i in range(layers):
        modules += [torch.nn.Linear(width, width, bias=bias)] + ([torch.nn.ReLU()] if i < layers - 1 else [])
    return torch.nn.Sequential(*modules)


def diloco(node, model: torch.nn.Module, *, inner_steps: int = INNER_STEPS, **kw):
    """A DiLoCo member of :data:`GROUP` on ``node`` (SGD inner steps)."""
    import meshd.learning as ml

    return ml.DiLoCo(node, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.05), group=GROUP,
                     inner_steps=inner_steps, **kw)


class Progress:
    """An event set (and renewed) whenever a trainer records something."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def changed(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def until(self, condition: Callable[[], bool], timeout: float) -> None:
        """Return once ``condition()`` holds; trio.TooSlowError after ``timeout`` seconds."""
        with trio.fail_after(timeout):
            while not condition():
                await self._event.wait()


class Trainer:
    """One DiLoCo member's training loop, recording ``hashes[round]`` after every outer round."""

    def __init__(self, opt, model: torch.nn.Module, progress: Progress, *, seed: int, width: int = 16,
                 on_round: Callable[[int, bytes, int], None] | None = None):
        """``on_round(round, hash, contributors)`` is called after each record (contributors:
        of the member's last exchange of that round, 0 if it had none)."""
        self.opt, self.model, self.progress = opt, model, progress
        self.width = width
        self.on_round = on_round
        self.hold: tuple[int, trio.Event] | None = None  # (round, go): after that round, wait for go
        self.hashes: dict[int, bytes] = {}  # round -> the state hash published after it
        self._gen = torch.Generator().manual_seed(seed)

    @property
    def group(self):
        return self.opt.group

    def last_round(self) -> int:
        return max(self.hashes, default=-1)

    def full_rounds(self, members: int) -> list[int]:
        """The rounds whose exchanges had ``members`` members' pseudo-gradients (this one's included)."""
        return sorted({r.round for r in self.opt.reports if r.contributors == members})

    async def until_live(self, members: int, timeout: float = 10.0) -> None:
        """Wait until this member hears ``members`` live members (itself included)."""
        with trio.fail_after(timeout):
            while len(self.group.live()) < members:
                await self.group._heard.wait()

    async def run(self, steps: int | None = None) -> None:
        """Take ``steps`` inner steps (forever if None), recording each outer round's hash."""
        seen = self.group.hash_round
        taken = 0
        while steps is None or taken < steps:
            x = torch.randn(16, self.width, generator=self._gen)
            self.model(x).pow(2).mean().backward()
            await self.opt.step(samples=16)
            taken += 1
            if self.group.hash_round != seen:
                seen = self.group.hash_round
                self.hashes[seen] = self.group.hash
                if self.on_round is not None:
                    last = [r for r in self.opt.reports if r.round == seen]
                    self.on_round(seen, self.group.hash, last[-1].contributors if last else 0)
                self.progress.changed()
                if self.hold is not None and seen >= self.hold[0]:
                    await self.hold[1].wait()


def shared_full_rounds(hashes: dict[int, bytes], full: list[int], survivors: list[Trainer]) -> list[int]:
    """The rounds in ``full`` that the restarted member (``hashes``) and every survivor ended
    with the same hash."""
    return [r for r in full if r in hashes and all(t.hashes.get(r) == hashes[r] for t in survivors)]


def check_caught_up(hashes: dict[int, bytes], full: list[int], resyncs: int, survivors: list[Trainer],
                    behind: int, *, slips: int = 2) -> None:
    """Assert that a restarted member with these records caught up with ``survivors``.

    ``hashes``: its hash per round; ``full``: the rounds whose exchange had
    every member's pseudo-gradient, its own included; ``behind``: the round
    the group worked on when it came back.  Its first hash is of a round no
    earlier than the one before ``behind`` (it took the current state, not its
    own init or an old one); the survivors agree with each other; at least two
    full rounds ended with the same hash on every member; and so did the last
    round it shares with them.  A round that ends apart (a member reaching it
    after the others' deadline ends it alone: docs/learning.md) is allowed
    ``slips`` times, each put back by a hash check (``resyncs``), no more."""
    assert hashes, "the restarted member reported no round"
    assert min(hashes) >= behind - 1, f"it started from round {min(hashes)}, the group was at {behind}"
    apart = [r for r, digest in sorted(hashes.items()) if {t.hashes[r] for t in survivors if r in t.hashes} - {digest}]
    assert len(apart) <= slips and resyncs <= slips, f"ended apart from the survivors in rounds {apart}, " \
                                                     f"{resyncs} resyncs"
    shared = [r for r in hashes if all(r in t.hashes for t in survivors)]
    assert shared and max(shared) not in apart, f"the last shared round {max(shared, default=None)} ended apart"
    for r in set.intersection(*(set(t.hashes) for t in survivors)):
        assert len({t.hashes[r] for t in survivors}) == 1, f"round {r}: the survivors' hashes differ"
    assert len(shared_full_rounds(hashes, full, survivors)) >= 2, (full, sorted(hashes), apart)


@dataclass
class Running:
    """One member node and its training loop, until ``scope`` is cancelled (``stopped``: it has
    closed); ``rounds``: round -> (hash, contributors, trio time it was recorded)."""

    data_dir: object
    node: object
    trainer: "Trainer"
    scope: trio.CancelScope
    stopped: trio.Event
    rounds: dict = field(default_factory=dict)


async def run_member(data_dir, bootstrap, config, progress: Progress, seed: int, *, inner_steps: int = INNER_STEPS,
                     count: int = 3, steps: int | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A node in ``data_dir`` (its identity is kept there) with a DiLoCo member that waits for
    ``count`` live members, as a training script does, then trains until the scope it hands
    out (in a :class:`Running`, through ``task_status``) is cancelled, or for ``steps`` inner
    steps and then closes its node."""
    stopped = trio.Event()
    try:
        with trio.CancelScope() as scope:
            async with meshd.open_node(data_dir, listen="127.0.0.1:0", config=config,
                                       bootstrap=[str(bootstrap)] if bootstrap else []) as node:
                if bootstrap:
                    await node.connect(bootstrap)
                model = tiny_model(seed)
                rounds: dict = {}

                def on_round(round_: int, digest: bytes, contributors: int) -> None:
                    rounds[round_] = (digest, contributors, trio.current_time())

                trainer = Trainer(diloco(node, model, inner_steps=inner_steps), model, progress, seed=seed,
                                  on_round=on_round)
                task_status.started(Running(data_dir, node, trainer, scope, stopped, rounds))
                await trainer.until_live(count)
                await trainer.run(steps)
    finally:
        stopped.set()
