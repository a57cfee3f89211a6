"""The chaos soak, short: 7 real daemons on loopback write one document, put and
get DHT records and publish and fetch a model for 30 s while one is SIGKILLed
and restarted every few seconds, and two expert server processes serve one
expert to a caller calling it throughout while the server in use is SIGKILLed
and restarted; then every acknowledged write must be on every replica, every
completed fetch verified, every expert call answered correctly or failed
cleanly, the calls while a server was down answered by the other, no daemon
or server crashed, memory bounded.

The training rounds (DiLoCo member processes, one SIGKILLed and restarted)
run in the long soak only: a dead member costs its group 10-60 s on 2 loaded
cores (docs/soak.md), more than this test's budget; their checks are tested
here on made-up reports.  The long run (30 daemons, a NAT lab, training and
experts, minutes) is ``benchmarks/soak.py``; docs/soak.md says what each check means.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import trio

from meshd.testing.soak import (
    SOAK_CONFIG,
    ChaosPlan,
    ExpertPlan,
    SoakPlan,
    TrainingLog,
    TrainingPlan,
    loopback_cluster,
    print_report,
    run_soak,
)
from meshd.testing.soak.scripts import Progress, Script
from meshd.testing.soak.training import training_checks

NODES = 7
PLAN = SoakPlan(duration=30.0, writers=2, dht_workers=1, fetchers=1, converge_timeout=20.0,
                chaos=ChaosPlan(kill_every=4.0, down_time=1.5, max_down=2), experts=ExpertPlan())


async def test_acknowledged_work_survives_sigkills_and_restarts(tmp_path):
    with trio.fail_after(150):
        cluster = loopback_cluster(tmp_path / "daemons", NODES, SOAK_CONFIG)
        report = await run_soak([cluster], PLAN, tmp_path / "work")
    print_report(report)
    assert report.failures == []
    ledger = report.ledgers[cluster.name]
    assert report.chaos.kills >= 3 and report.chaos.restarts == report.chaos.kills
    assert len(ledger.acked) >= 50 and ledger.tally("dht put").ok >= 10
    assert ledger.tally("fetch").ok >= 2 and len(ledger.models) >= 2
    experts = report.experts
    assert experts.killed is not None and sum(call.peer is not None for call in experts.calls) >= 20
    assert [s.name for s in experts.scripts if s.killed] == [experts.killed]


def member(name: str, rounds: list[tuple[int, str]], *, done=True, code=0, killed=False) -> Script:
    """A member that reported ``rounds`` (round, hash) and exited with ``code``."""
    script = Script(name, [], Path("/nonexistent") / f"{name}.log", Progress(),
                    process=SimpleNamespace(returncode=code, poll=lambda: code))
    script.lines = [{"round": r, "hash": h, "_at": float(r)} for r, h in rounds]
    script.done = {"done": True, "_at": 9.0} if done else None
    script.killed = killed
    return script


def verdicts(log: TrainingLog) -> dict[str, bool]:
    return {check.name.split(": ", 1)[1]: check.passed for check in training_checks(log)}


def test_training_checks_hold_live_members_to_one_hash_after_their_last_round():
    plan = TrainingPlan(members=3, steps=40, inner_steps=10, kill_at=1)
    same = [(r, f"h{r}") for r in range(4)]
    log = TrainingLog(plan, [member("m0", same), member("m1", same), member("m2", same[:2], done=False, code=-9,
                                                                             killed=True),
                             member("m2'", same[2:])], killed_at=1, victim="m2", back_at=2, seconds=9.0)
    assert all(verdicts(log).values())
    # a member off the majority in one round, which took the group's state after: passes, and is named
    log.scripts[1].lines[2]["hash"] = "other"
    assert all(verdicts(log).values())
    assert "until it took the group's state: [2]" in training_checks(log)[1].detail
    # ending on another hash, or a round short, or exiting unkilled without finishing: each fails its check
    log.scripts[1].lines[3]["hash"] = "other"
    assert verdicts(log)["live members' hashes equal after their last round"] is False
    log.scripts[1].lines[3]["hash"] = "h3"
    del log.scripts[0].lines[3]
    assert verdicts(log)["every round completed"] is False
    log.scripts[0].lines.append({"round": 3, "hash": "h3", "_at": 3.0})
    log.scripts[3].process = SimpleNamespace(returncode=1, poll=lambda: 1)
    log.scripts[3].done = None
    assert verdicts(log)["no member exited but the killed one"] is False
    # told to end on round 3 of a budget of 40: the group ends there
    long = TrainingPlan(members=3, steps=400, inner_steps=10, kill_at=1)
    told = TrainingLog(long, [member("m0", same), member("m1", same), member("m2", same[:2], done=False, code=-9,
                                                                              killed=True),
                              member("m2'", same[2:])], killed_at=1, victim="m2", back_at=2, seconds=9.0)
    assert verdicts(told)["every round completed"] is False  # 4 of 40 rounds
    told.stop_after = 3
    assert all(verdicts(told).values())
    # a restart that never reported a round
    log = TrainingLog(plan, [member("m0", same), member("m1", same)], killed_at=1, victim="m2", back_at=None)
    assert verdicts(log)["every round completed"] is False
