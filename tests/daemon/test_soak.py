"""The chaos soak, short: 7 real daemons on loopback write one document, put and
get DHT records and publish and fetch a model for 30 s while one is SIGKILLed
and restarted every few seconds; then every acknowledged write must be on
every replica, every completed fetch verified, no daemon crashed, memory bounded.

The long run (30 daemons and a NAT lab, minutes) is ``benchmarks/soak.py``;
docs/soak.md says what each check means.
"""

from __future__ import annotations

import trio

from meshd.testing.soak import SOAK_CONFIG, ChaosPlan, SoakPlan, loopback_cluster, print_report, run_soak

NODES = 7
PLAN = SoakPlan(duration=30.0, writers=2, dht_workers=1, fetchers=1, converge_timeout=20.0,
                chaos=ChaosPlan(kill_every=4.0, down_time=1.5, max_down=2))


async def test_acknowledged_work_survives_sigkills_and_restarts(tmp_path):
    with trio.fail_after(100):
        cluster = loopback_cluster(tmp_path / "daemons", NODES, SOAK_CONFIG)
        report = await run_soak([cluster], PLAN, tmp_path / "work")
    print_report(report)
    assert report.failures == []
    ledger = report.ledgers[cluster.name]
    assert report.chaos.kills >= 3 and report.chaos.restarts == report.chaos.kills
    assert len(ledger.acked) >= 50 and ledger.tally("dht put").ok >= 10
    assert ledger.tally("fetch").ok >= 2 and len(ledger.models) >= 2
