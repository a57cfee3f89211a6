"""The chaos of a soak: SIGKILL and restart, link cuts, and a watch for crashes and memory.

Each loop runs until its deadline and at most a bounded number of times. A
killed daemon is restarted on its data dir after ``down_time``; at most
``max_down`` slots are down at once, so the mesh always has most of its
nodes.  A cut lasts ``cut_time`` and is always restored, even when the loop
is cancelled.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import trio

from ..localmesh import DaemonError
from .mesh import Cluster, Cut, Slot


@dataclass
class ChaosPlan:
    """How often and how hard: seconds between kills and between cuts, how long each lasts."""

    kill_every: float = 4.0
    down_time: float = 2.0
    max_down: int = 2
    cut_every: float = 20.0
    cut_time: float = 8.0
    max_events: int = 10_000  # a bound on every loop besides the deadline


@dataclass
class ChaosLog:
    """What the chaos did, and what it saw go wrong."""

    kills: int = 0
    mid_operation: int = 0  # kills that struck a daemon with an operation in flight
    restarts: int = 0
    cuts: int = 0
    restart_failures: list[str] = field(default_factory=list)
    cut_names: list[str] = field(default_factory=list)


def bootstrap_of(cluster: Cluster) -> list[str]:
    """Where a restarted slot of ``cluster`` bootstraps: the seed."""
    return [cluster.seed.daemon.dial_address]


async def start_slot(cluster: Cluster, slot: Slot, log: ChaosLog | None = None) -> bool:
    """Start ``slot``'s daemon in a thread; True if it printed ``ready``."""
    bootstrap = [] if slot is cluster.seed else bootstrap_of(cluster)
    try:
        await trio.to_thread.run_sync(slot.start, bootstrap)
    except DaemonError as exc:
        if log is None:
            raise
        log.restart_failures.append(f"{slot.name}: {exc}")
        return False
    return True


async def kill_and_restart(clusters: list[Cluster], plan: ChaosPlan, log: ChaosLog, rng: random.Random,
                           deadline: float) -> None:
    """Every ``kill_every`` s (jittered) SIGKILL a random non-seed slot, one with an operation
    in flight if any; restart it ``down_time`` s later."""

    async def later(cluster: Cluster, slot: Slot) -> None:
        await trio.sleep(plan.down_time)
        if await start_slot(cluster, slot, log):
            log.restarts += 1

    async with trio.open_nursery() as restarts:
        with trio.move_on_at(deadline):  # then wait for the restarts still pending
            for _ in range(plan.max_events):
                await trio.sleep(plan.kill_every * rng.uniform(0.5, 1.5))
                down = sum(not slot.up for cluster in clusters for slot in cluster.victims)
                choices = [(c, s) for c in clusters for s in c.victims if s.up]
                if down >= plan.max_down or not choices:
                    continue
                busy = [(c, s) for c, s in choices if s.busy]  # strike mid-operation when one is in flight
                cluster, slot = rng.choice(busy or choices)
                slot.kill()
                log.kills += 1
                log.mid_operation += bool(busy)
                restarts.start_soon(later, cluster, slot)


async def cut_and_restore(cuts: list[Cut], plan: ChaosPlan, log: ChaosLog, rng: random.Random,
                          deadline: float) -> None:
    """Every ``cut_every`` s cut a random link for ``cut_time`` s; the link is back when this returns."""
    for _ in range(plan.max_events if cuts else 0):
        with trio.move_on_at(deadline - plan.cut_time) as wait:
            await trio.sleep(plan.cut_every * rng.uniform(0.5, 1.5))
        if wait.cancelled_caught:
            return
        cut = rng.choice(cuts)
        await trio.to_thread.run_sync(cut.cut)
        log.cuts += 1
        log.cut_names.append(cut.name)
        try:
            await trio.sleep(plan.cut_time)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(cut.restore)


async def watch(clusters: list[Cluster], interval: float = 1.0) -> None:
    """Until cancelled: every ``interval`` s note crashed processes and sample every daemon's memory."""
    while True:
        for cluster in clusters:
            for slot in cluster.slots:
                if slot.check_alive() and slot.up:
                    slot.sample_rss()
        await trio.sleep(interval)
