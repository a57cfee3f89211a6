"""Which servers a registry entry still counts (meshd.services.experts.registry)."""

from meshd.services.experts.registry import STALE_AFTER, live_servers


def test_servers_are_live_until_they_miss_three_heartbeats():
    servers = {"p1": {"since": 0.0, "seen": 100.0}, "p2": {"since": 0.0, "seen": 100.0 - 1e-3},
               "p3": {"since": 95.0}}  # an entry from before heartbeats: its start counts
    now = 100.0 + STALE_AFTER * 10.0
    assert live_servers(servers, now=now, heartbeat=10.0) == (["p1"], ["p2", "p3"])


def test_malformed_entries_from_peers_are_stale_not_errors():
    servers = {"p1": "junk", "p2": {"seen": "yesterday"}, "p3": {}, "p4": {"seen": 9.0}}
    assert live_servers(servers, now=10.0, heartbeat=1.0) == (["p4"], ["p1", "p2", "p3"])
    assert live_servers("not a map", now=0.0, heartbeat=1.0) == ([], [])
