"""Training rounds in a soak: DiLoCo member processes in one group while one is SIGKILLed and comes back.

Every member is ``examples/train_digits.py`` (the digits MLP of
:mod:`meshd.testing.digits`, AdamW inner steps, DiLoCo outer steps every
``inner_steps``), the script ``benchmarks/learning_churn.py`` runs, each in a
process of its own with its own in-process node bootstrapped through the
cluster's seed daemon, one torch thread.  Each prints its state hash after
every outer round.  Once the group has reached round ``kill_at`` the last
member is SIGKILLed (by its PID); ``down_time`` s later it is started again
on its data dir (the same identity, a fresh process with another init): it
takes the group's state and round from a live member and trains on with the
others.  Once it has reported ``rounds_back`` rounds (or its restart
failed), every member is told to end ``rounds_after`` rounds after the
group's latest (a stop file each member reads after every round), so the
members end together whatever the machine's speed: with only ``steps``,
fast rounds let the others finish before the restarted member was back.
Meanwhile the daemons around them are killed and restarted by the soak's
chaos.

The checks (:func:`training_checks`): the group completed every round and
each member not killed finished; every member that reported a round reported
the same hash for it (bit-identical parameters and outer momentum, as
``benchmarks/learning_churn.py`` checks), so every live member ends on the
same hash after its last round; and no member process exited but the killed
one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import trio

from .checks import Check
from .mesh import Cluster
from .scripts import REPO, Progress, Script, python

MEMBER = REPO / "examples" / "train_digits.py"


@dataclass
class TrainingPlan:
    """The training of a soak: members, how long they train, when one is killed and back."""

    members: int = 3
    steps: int = 400  # inner steps each member takes at most (steps // inner_steps rounds)
    inner_steps: int = 10  # H
    kill_at: int | None = 3  # the round at which the last member is SIGKILLed (None: no kill)
    down_time: float = 1.0  # seconds before it is started again
    same_identity: bool = True  # it comes back on its data dir (its key); False: a new member joins instead
    rounds_back: int = 2  # rounds the restarted member reports before the members are told when to end
    rounds_after: int = 3  # ... which is this many rounds after the group's latest then
    timeout: float = 240.0  # bound on the whole training, starts included
    start_timeout: float = 180.0  # bound on one member's start (importing torch took over 60 s at a load of 36)
    group: str = "soak-digits"

    @property
    def rounds(self) -> int:
        return self.steps // self.inner_steps


@dataclass
class TrainingLog:
    """What the members did and reported."""

    plan: TrainingPlan
    scripts: list[Script] = field(default_factory=list)  # every member process, the restart last
    killed_at: int | None = None  # the group's round when the member was killed
    victim: str = ""  # which
    back_at: int | None = None  # the first round the restarted member reported
    start_failures: list[str] = field(default_factory=list)
    timed_out: bool = False
    seconds: float = 0.0
    stop_after: int | None = None  # the round the members were told to end after, if they were

    def last(self) -> int:
        """The round the group is to end on: the one it was told, or its last by its steps."""
        last = self.plan.rounds - 1
        return last if self.stop_after is None else min(last, self.stop_after)

    def reports(self) -> dict[int, dict[str, str]]:
        """Round -> {member: hash} for every round any member reported."""
        rounds: dict[int, dict[str, str]] = {}
        for script in self.scripts:
            for line in script.lines:
                if "round" in line and "hash" in line:
                    rounds.setdefault(line["round"], {})[script.name] = line["hash"]
        return rounds

    def top_round(self) -> int:
        return max(self.reports(), default=-1)

    def survivors(self) -> list[Script]:
        return [script for script in self.scripts if not script.killed]

    def last_round(self, script: Script) -> tuple[int, str] | None:
        """The last round ``script`` reported and its hash."""
        rounds = [(line["round"], line["hash"]) for line in script.lines if "round" in line and "hash" in line]
        return rounds[-1] if rounds else None


def member_cmd(plan: TrainingPlan, data_dir: Path, share: int, wait_for: int, bootstrap: str,
               stop_file: Path) -> list[str]:
    return python(str(MEMBER), "--data-dir", str(data_dir), "--json", "--bootstrap", bootstrap,
                  "--group", plan.group, "--member", str(share), "--members", str(plan.members),
                  "--steps", str(plan.steps), "--inner-steps", str(plan.inner_steps), "--wait-for", str(wait_for),
                  "--stop-file", str(stop_file), "-v")


async def run_training(cluster: Cluster, plan: TrainingPlan, folder: Path, log: TrainingLog) -> None:
    """Train the group to the end (``plan.timeout`` s at most), killing and restarting one member
    on the way; every member process is killed by its PID when this returns."""
    progress = Progress()
    bootstrap = cluster.seed.daemon.dial_address
    began = trio.current_time()
    folder = Path(folder)

    def member(i: int, share: int, wait_for: int, restart: int = 0) -> Script:
        name = f"m{i}" + ("'" * restart)
        script = Script(name, member_cmd(plan, folder / f"m{i}", share, wait_for, bootstrap, folder / "stop"),
                        folder / f"m{i}.log", progress)
        log.scripts.append(script)
        return script

    async def start(nursery: trio.Nursery, script: Script) -> None:
        if not await script.start(nursery, timeout=plan.start_timeout):
            log.start_failures.append(f"{script.name}: {script.tail_log(3)}")

    async with trio.open_nursery() as nursery:
        try:
            with trio.move_on_after(plan.timeout) as bound:
                async with trio.open_nursery() as starts:
                    for i in range(plan.members):
                        starts.start_soon(start, nursery, member(i, i, plan.members))
                if log.start_failures:
                    return
                victim = log.scripts[-1]
                reached = plan.kill_at is not None and await progress.until(
                    lambda: log.top_round() >= plan.kill_at or victim.exited.is_set(), plan.timeout)
                if reached and not victim.exited.is_set():
                    log.killed_at, log.victim = log.top_round(), victim.name
                    victim.kill()
                    await victim.reap()
                    await trio.sleep(plan.down_time)  # how long it stays down: chaos timing, not a wait
                    back = (member(plan.members - 1, plan.members - 1, 2, restart=1) if plan.same_identity
                            else member(plan.members, plan.members - 1, 2))
                    await start(nursery, back)
                    await progress.until(lambda: sum("round" in line for line in back.lines) >= plan.rounds_back
                                         or back.exited.is_set(), plan.timeout)
                    log.back_at = next((line["round"] for line in back.lines if "round" in line), None)
                    log.stop_after = log.top_round() + plan.rounds_after
                    staged = folder / "stop.new"  # renamed into place: a member never reads half of it
                    staged.write_text(str(log.stop_after))
                    staged.replace(folder / "stop")  # all end together, on that round
                for script in log.survivors():
                    await script.exited.wait()
                    await script.reap()
            log.timed_out = bound.cancelled_caught
        finally:
            log.seconds = trio.current_time() - began
            with trio.CancelScope(shield=True):
                for script in log.scripts:
                    script.stop()
                    await script.reap()
            nursery.cancel_scope.cancel()


def longest_round(log: TrainingLog) -> float:
    """The longest wait between two rounds the group reported (what a dead member costs)."""
    first: dict[int, float] = {}
    for script in log.scripts:
        for line in script.lines:
            if "round" in line and "hash" in line:
                first[line["round"]] = min(first.get(line["round"], line["_at"]), line["_at"])
    times = [first[r] for r in sorted(first)]
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def training_checks(log: TrainingLog) -> list[Check]:
    """Rounds completed, every live member's hash equal after its last round, no member crashed."""
    plan = log.plan
    reports = log.reports()
    last = log.last()
    survivors = log.survivors()
    finished = [s.name for s in survivors
                if s.done is not None and log.last_round(s) is not None and log.last_round(s)[0] == last]
    unfinished = [s.name for s in survivors if s.name not in finished]
    killed = [s.name for s in log.scripts if s.killed]
    story = (f"{len(reports)} of {last + 1} rounds (H={plan.inner_steps}), {len(finished)} members finished in "
             f"{log.seconds:.0f} s, longest round {longest_round(log):.1f} s")
    if log.killed_at is not None:
        story += f"; {log.victim or 'a member'} SIGKILLed at round {log.killed_at}, back" + (
            f" from round {log.back_at}" if log.back_at is not None else " but reported no round")
    why = []
    if log.start_failures:
        why.append(f"did not start: {log.start_failures}")
    if log.timed_out:
        why.append(f"not done within {plan.timeout:.0f} s")
    if unfinished:
        why.append(f"unfinished: {unfinished}")
    complete = not why and (plan.kill_at is None or (log.killed_at is not None and log.back_at is not None))
    ends = {s.name: log.last_round(s) for s in survivors}
    final = set(ends.values())
    equal = len(final) == 1 and None not in final
    off = sorted(r for r, hashes in reports.items() if len(set(hashes.values())) > 1)
    if equal:
        [(round_, digest)] = final
        hashes = f"{len(ends)} live members end on round {round_} with hash {digest[:12]}"
    else:
        hashes = "last rounds differ: " + ", ".join(
            f"{name} {end[0]} {end[1][:8]}" if end else f"{name} none" for name, end in ends.items())
        back = log.scripts[-1] if len(log.scripts) > plan.members else None  # the one started after the kill
        done_at = [s.done["_at"] for s in survivors if s.done is not None and s is not back]
        first = next((line["_at"] for line in back.lines if "round" in line), None) if back else None
        if first is not None and done_at and first > min(done_at):
            hashes += (f" ({back.name} reported its first round after the others finished: it trained alone;"
                       " give the members more steps)")
    hashes += (f"; {sum(len(h) for h in reports.values())} reports, every round agreed" if not off else
               f"; rounds where a member was off the majority until it took the group's state: {off}")
    crashed = {s.name: s.crash() for s in log.scripts if s.crash()}
    return [
        Check("training: every round completed", complete, story + (f"; {'; '.join(why)}" if why else "")),
        Check("training: live members' hashes equal after their last round", equal, hashes),
        Check("training: no member exited but the killed one", not crashed,
              f"{len(log.scripts)} member processes, {len(killed)} killed" if not crashed else f"crashed: {crashed}"),
    ]
