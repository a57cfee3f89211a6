"""The chaos soak across the NAT lab: a public relay, a second public node and three
hosts behind home and symmetric NATs beside four daemons on loopback, 40 s of mixed
work while daemons are SIGKILLed and restarted and a NAT host's router stops
forwarding for a while.  Afterwards every acknowledged write is on every replica of both clusters, every
completed fetch verified, no daemon crashed, memory bounded (docs/soak.md).
"""

from __future__ import annotations

import trio

from meshd.testing.soak import SOAK_CONFIG, ChaosPlan, SoakPlan, loopback_cluster, print_report, run_soak
from natlab import natlab  # noqa: F401 (the fixture)
from soak_lab import lab_cluster

PLAN = SoakPlan(duration=40.0, writers=2, dht_workers=1, fetchers=1, converge_timeout=30.0,
                chaos=ChaosPlan(kill_every=5.0, down_time=1.5, max_down=2, cut_every=10.0, cut_time=6.0))


async def test_acknowledged_work_survives_kills_and_cut_links_behind_nats(natlab, tmp_path):  # noqa: F811
    with trio.fail_after(120):
        lab = lab_cluster(natlab, tmp_path / "daemons", 3, SOAK_CONFIG)
        loopback = loopback_cluster(tmp_path / "daemons", 4, SOAK_CONFIG)
        report = await run_soak([loopback, lab], PLAN, tmp_path / "work")
    print_report(report)
    assert report.failures == []
    assert report.chaos.kills >= 3 and report.chaos.cuts >= 1
    for cluster in (loopback, lab):
        ledger = report.ledgers[cluster.name]
        assert len(ledger.acked) >= 20 and ledger.tally("fetch").ok >= 1
