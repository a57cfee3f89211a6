"""Operating a real daemon: its Prometheus exporter scraped over HTTP, its JSON log
lines, and ``meshctl top`` (docs/operations.md)."""

from __future__ import annotations

import json
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from test_daemons import daemons  # noqa: F401  (the fixture)

OBSERVED = {"metrics": {"listen": "127.0.0.1:0"},
            "node": {"log_level": "warning"},
            "log": {"format": "json", "levels": {"meshd.node": "info"}}}


def _scrape(address: str) -> dict:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_json_logs_and_top_of_a_running_daemon(daemons):
    a = daemons("a", config=OBSERVED)
    b = daemons("b", bootstrap=[a.dial_address])
    b.meshctl("ping", a.peer_id, "-c", "3")

    exporter = a.meshctl("status")["metrics"]["exporter"]
    samples = _scrape(exporter)
    assert samples[("meshd_rpc_served_seconds_count", (("method", "ping"),))] == 3
    assert samples[("meshd_connections", (("path", "direct"),))] == 1
    assert samples[("meshd_dht_contacts", ())] >= 0
    assert samples[("python_gc_frozen_objects", ())] > 10_000  # what starting made, out of every collection
    assert samples[("python_gc_collections_total", (("generation", "0"),))] >= 0

    top = a.meshctl_raw("top", "--once", "--interval", "0.2")
    assert top.returncode == 0, top.stderr
    for expected in ("1 peers", b.peer_id[:16], "direct", "calls", "bytes", "documents", "fetches"):
        assert expected in top.stdout, expected
    view = a.meshctl("top", "--once", "--interval", "0.1")
    assert view["snapshot"]["rpc"]["served"]["ping"]["errors"] == {}
    assert [p["peer_id"] for p in view["peers"]] == [b.peer_id]

    assert a.stop() == 0
    events = [json.loads(line) for line in a.log_path.read_text().splitlines()]
    assert events and all({"ts", "level", "subsystem", "message"} <= set(e) for e in events)
    subsystems = {(e["subsystem"], e["level"]) for e in events}
    assert ("meshd.node", "info") in subsystems  # its own level: info
    assert not any(e["level"] == "info" and e["subsystem"] != "meshd.node" for e in events)  # the rest: warning
    assert any("listening at" in e["message"] for e in events)
