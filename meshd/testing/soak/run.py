"""The soak driver: start the clusters, work and break them for a while, then check.

:func:`run_soak` promises to leave no process behind: every daemon it started
is SIGKILLed by its PID when it returns or raises, whatever happened.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import trio

import meshd
from .chaos import ChaosLog, ChaosPlan, cut_and_restore, kill_and_restart, start_slot, watch
from .checks import (
    Check,
    converge,
    document_checks,
    dht_checks,
    fetch_checks,
    process_checks,
    read_back_dht,
)
from .expert_calls import ExpertLog, ExpertPlan, expert_checks, run_expert_calls
from .mesh import Cluster
from .scripts import Window
from .training import TrainingLog, TrainingPlan, run_training, training_checks
from .work import Ledger, ModelSource, Pace, fetch_models, open_document, publish_models, put_and_get, \
    write_document

# What a daemon of the soak runs with: dead peers noticed in about a second, a
# dead DHT contact costs 2 s, documents sync every second (as the daemon tests do).
SOAK_CONFIG = {
    "transport": {"idle_timeout": 3.0, "keepalive_interval": 0.5, "handshake_timeout": 2.0},
    "dht": {"request_timeout": 2.0},
    "crdt": {"sync_interval": 1.0, "discover_interval": 2.0},
}


@dataclass
class SoakPlan:
    """The whole run: how long, how many workers of each kind per cluster, the bounds checked."""

    duration: float = 30.0
    writers: int = 2
    dht_workers: int = 1
    fetchers: int = 1
    converge_timeout: float = 60.0
    rss_bound_mib: int = 200  # docs/soak.md: a daemon under this work stays near 60-100 MiB
    seed: int = 0
    pace: Pace = field(default_factory=Pace)
    chaos: ChaosPlan = field(default_factory=ChaosPlan)
    training: TrainingPlan | None = None  # DiLoCo member processes beside the first local cluster
    experts: ExpertPlan | None = None  # expert servers and a caller beside the first local cluster


@dataclass
class SoakReport:
    plan: SoakPlan
    clusters: list[Cluster]
    ledgers: dict[str, Ledger]
    chaos: ChaosLog
    checks: list[Check]
    phases: dict[str, float]  # seconds each phase took: start, join, work, recover, check
    training: TrainingLog | None = None
    experts: ExpertLog | None = None

    @property
    def wall(self) -> float:
        return sum(self.phases.values())

    @property
    def failures(self) -> list[Check]:
        return [check for check in self.checks if not check.passed]


async def run_soak(clusters: list[Cluster], plan: SoakPlan, folder: Path) -> SoakReport:
    """Start every slot, run ``plan.duration`` s of work under chaos, bring every slot back, check.

    ``folder`` takes the model files and the fetched copies.  Returns the
    report (its ``failures`` are the checks that failed); raises only for a
    bug (an error no killed or cut daemon explains) or a start that failed.
    """
    phases = Phases()
    rng = random.Random(plan.seed)
    ledgers = {cluster.name: Ledger() for cluster in clusters}
    log = ChaosLog()
    scripts = Scripts(plan, clusters)
    try:
        await _start_all(clusters)
        phases.lap("start")
        async with trio.open_nursery() as beside:  # script processes start while the mesh joins
            scripts.start(beside, Path(folder), random.Random(f"{plan.seed}/scripts"))
            lonely = await _joined(clusters, plan.converge_timeout)
            for cluster in clusters:
                await open_document(cluster, ledgers[cluster.name])
            phases.lap("join")
            async with trio.open_nursery() as watching:
                watching.start_soon(watch, clusters)
                await _work(clusters, ledgers, plan, log, rng, Path(folder), scripts)
                phases.lap("work")
                for cluster in clusters:  # a restart that failed gets one more try
                    for slot in cluster.victims:
                        if not slot.up and not slot.crashes and await start_slot(cluster, slot, log):
                            log.restarts += 1
                phases.lap("recover")
                checks = await _check(clusters, ledgers, plan) + scripts.checks()
                phases.lap("check")
                watching.cancel_scope.cancel()
        if lonely:
            checks.insert(0, Check("every daemon joined the DHT before the work", False,
                                   f"alone: {lonely}; " + _why_alone(clusters, lonely)))
        for cluster in clusters:
            for slot in cluster.live():
                slot.sample_rss()
        checks += process_checks(clusters, plan.rss_bound_mib)
        if log.restart_failures:
            checks.append(Check("every restart started", False, "; ".join(log.restart_failures)))
        return SoakReport(plan, clusters, ledgers, log, checks, phases.seconds, scripts.training, scripts.experts)
    finally:
        for cluster in clusters:
            for slot in cluster.slots:
                slot.stop()


async def _start_all(clusters: list[Cluster]) -> None:
    """The seeds, then every other slot (which bootstrap through them), in parallel; a failed start raises."""
    async with trio.open_nursery() as nursery:
        for cluster in clusters:
            nursery.start_soon(start_slot, cluster, cluster.seed)
    async with trio.open_nursery() as nursery:
        for cluster in clusters:
            for slot in cluster.victims:
                nursery.start_soon(start_slot, cluster, slot)


async def _joined(clusters: list[Cluster], timeout: float) -> list[str]:
    """Wait (at most ``timeout`` s) until every daemon knows a DHT contact, as a mesh that is up
    does; the names of those that still know none."""
    waiting = {slot.name for cluster in clusters for slot in cluster.slots}

    async def one(slot) -> None:
        while True:
            async with meshd.connect(slot.daemon.data_dir) as client:
                if (await client.dht_routing())["size"]:
                    waiting.discard(slot.name)
                    return
            await trio.sleep(0.5)

    with trio.move_on_after(timeout):
        async with trio.open_nursery() as nursery:
            for cluster in clusters:
                for slot in cluster.slots:
                    nursery.start_soon(one, slot)
    return sorted(waiting)


def _why_alone(clusters: list[Cluster], lonely: list[str]) -> str:
    """What each lonely daemon's log said last of AutoNAT and the DHT (why it had not joined)."""
    said = []
    for slot in (slot for cluster in clusters for slot in cluster.slots if slot.name in lonely):
        lines = [line for line in slot.daemon.tail_log(400).splitlines() if "autonat" in line or "dht" in line]
        said.append(f"{slot.name}: " + (" | ".join(lines[-4:]) or "nothing of AutoNAT or the DHT"))
    return "; ".join(said)


class Scripts:
    """The work of script processes (training members, expert servers and their caller), which
    runs beside the first cluster a process started here can reach (the loopback one).  The
    processes start once every daemon is up (started beside them, 35 daemons took over 30 s
    to start on 2 loaded cores), while the mesh joins; the calls begin with the work, and
    the work phase lasts until the training has ended (each bounded on its own)."""

    def __init__(self, plan: SoakPlan, clusters: list[Cluster]):
        self.cluster = next((cluster for cluster in clusters if cluster.local), None)
        self.training = TrainingLog(plan.training) if plan.training else None
        self.experts = ExpertLog(plan.experts) if plan.experts else None
        self.window = Window()
        self.ended: list[trio.Event] = []

    def start(self, nursery: trio.Nursery, folder: Path, rng: random.Random) -> None:
        if self.cluster is None:
            return
        if self.training is not None:
            nursery.start_soon(self._run, self._ended(), run_training, self.cluster, self.training.plan,
                               folder / "training", self.training)
        if self.experts is not None:
            nursery.start_soon(self._run, self._ended(), run_expert_calls, self.cluster, self.experts.plan,
                               folder / "experts", self.window, self.experts, _fork(rng), SOAK_CONFIG)

    def _ended(self) -> trio.Event:
        self.ended.append(trio.Event())
        return self.ended[-1]

    @staticmethod
    async def _run(ended: trio.Event, task, *args) -> None:
        try:
            await task(*args)
        finally:
            ended.set()

    async def work(self, deadline: float) -> None:
        """Let the calls begin, and return once every script task has ended."""
        self.window.open(deadline)
        for ended in self.ended:
            await ended.wait()

    def checks(self) -> list[Check]:
        if (self.training or self.experts) and self.cluster is None:
            return [Check("training and expert calls", False, "no cluster on this host (loopback) to run them by")]
        return ((training_checks(self.training) if self.training else [])
                + (expert_checks(self.experts) if self.experts else []))


async def _work(clusters: list[Cluster], ledgers: dict[str, Ledger], plan: SoakPlan, log: ChaosLog,
                rng: random.Random, folder: Path, scripts: Scripts) -> None:
    deadline = trio.current_time() + plan.duration
    pace = plan.pace
    async with trio.open_nursery() as nursery:
        for cluster in clusters:
            ledger = ledgers[cluster.name]
            for i in range(plan.writers):
                nursery.start_soon(write_document, cluster, ledger, _fork(rng), i, pace, deadline)
            for i in range(plan.dht_workers):
                nursery.start_soon(put_and_get, cluster, ledger, _fork(rng), i, pace, deadline)
            if plan.fetchers:
                source = ModelSource(folder / cluster.name / "models", _fork(rng), pace.model_mib)
                fetched = folder / cluster.name / "fetched"
                fetched.mkdir(parents=True, exist_ok=True)
                nursery.start_soon(publish_models, cluster, ledger, source, pace, deadline,
                                   plan.duration / pace.max_versions)
                for i in range(plan.fetchers):
                    nursery.start_soon(fetch_models, cluster, ledger, _fork(rng), i, pace, deadline, fetched)
        nursery.start_soon(kill_and_restart, clusters, plan.chaos, log, _fork(rng), deadline)
        cuts = [cut for cluster in clusters for cut in cluster.cuts]
        nursery.start_soon(cut_and_restore, cuts, plan.chaos, log, _fork(rng), deadline)
        nursery.start_soon(scripts.work, deadline)


async def _check(clusters: list[Cluster], ledgers: dict[str, Ledger], plan: SoakPlan) -> list[Check]:
    """The checks of each cluster's work; the clusters converge at the same time."""
    convergence = {}

    async def one(cluster: Cluster) -> None:
        convergence[cluster.name] = await converge(cluster, ledgers[cluster.name], plan.converge_timeout)

    async with trio.open_nursery() as nursery:
        for cluster in clusters:
            nursery.start_soon(one, cluster)
    checks = []
    for cluster in clusters:
        ledger = ledgers[cluster.name]
        checks += document_checks(cluster, ledger, convergence[cluster.name], plan.converge_timeout)
        checks += dht_checks(cluster, ledger, *await read_back_dht(cluster, ledger, plan.pace.op_timeout))
        if plan.fetchers:
            checks += fetch_checks(cluster, ledger)
    return checks


class Phases:
    """Seconds per phase, each lap measured from the end of the last."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = trio.current_time()

    def lap(self, name: str) -> None:
        now = trio.current_time()
        self.seconds[name], self._last = now - self._last, now


def _fork(rng: random.Random) -> random.Random:
    """An independent generator drawn from ``rng``, so each task's choices repeat with the seed."""
    return random.Random(rng.randrange(2**63))
