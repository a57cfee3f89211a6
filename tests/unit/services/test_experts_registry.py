"""Which servers a registry entry counts, and still counts (meshd.services.experts.registry)."""

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


def test_a_listing_says_each_servers_health_and_latency_and_sums_them_up():
    from experts.servers import Servers
    from meshd.services.experts.registry import describe_servers

    measured = Servers()
    measured.observe("fast", 0.002, True, now=0.0)
    measured.observe("slow", 0.010, True, now=0.0)
    measured.observe("down", 0.001, True, now=0.0)
    measured.observe("down", 0.5, False, now=9.0)  # backing off until 10.0
    listing = describe_servers(["down", "fast", "pinged", "silent", "slow", "unknown"], ["old"], measured=measured,
                               now=9.5, probes={"pinged": 0.0004, "silent": "no answer in 5 s"})
    peers = {p["peer"]: p for p in listing["peers"]}
    assert peers["fast"] == {"peer": "fast", "health": "ok", "latency_ms": 2.0, "latency_from": "calls"}
    assert peers["down"]["health"] == "backed-off" and peers["down"]["failures"] == 1
    assert peers["pinged"]["health"] == "ok" and peers["pinged"]["latency_from"] == "ping"
    assert peers["pinged"]["latency_ms"] == 0.4
    assert peers["silent"]["health"] == "failing" and peers["silent"]["error"] == "no answer in 5 s"
    assert peers["unknown"]["health"] == "ok" and peers["unknown"]["latency_ms"] is None
    assert peers["old"]["health"] == "stale"
    assert listing["health"] == "ok" and listing["latency_ms"] == 0.4  # the fastest server that is ok
    later = describe_servers(["down"], [], measured=measured, now=11.0)
    assert later["health"] == "failing" and later["latency_ms"] is None
    assert describe_servers([], ["old"])["health"] == "stale"
    assert describe_servers([], []) == {"peers": [], "health": "none", "latency_ms": None}


def test_a_server_row_counts_only_if_the_server_it_is_filed_under_wrote_it():
    from crdt.document import Document
    from crdt_helpers import Key, commit
    from meshd.identity import PeerId
    from meshd.services.experts.registry import read_registry

    owner, server, forger = Key("owner"), Key("server"), Key("forger")
    doc = Document(owner.pk, "experts")
    commit(doc, owner, lambda tx: [tx.grant(k.pk, "writer") for k in (server, forger)])
    me, victim = str(PeerId(server.pk)), str(PeerId(owner.pk))
    row = {"since": 1.0, "seen": 2.0, "load": {"calls": 0}}
    commit(doc, server, lambda tx: [tx.set(["lin", "about"], {"kind": "module"}),
                                    tx.set(["lin", "servers", me], row)])
    commit(doc, forger, lambda tx: [tx.set(["ghost", "about"], {"kind": "lm"}),
                                    tx.set(["ghost", "servers", victim], row),  # forged: the owner's id
                                    tx.set(["lin", "servers", "not a peer"], row)])
    listing = read_registry(doc)
    assert listing["lin"] == {"about": {"kind": "module"}, "servers": {me: row}, "rejected": ["not a peer"]}
    assert listing["ghost"] == {"about": {"kind": "lm"}, "servers": {}, "rejected": [victim]}
    # overwriting a server's own row hides it until the server writes again; it never lists the forger's
    commit(doc, forger, lambda tx: tx.set(["lin", "servers", me], {**row, "seen": 9.0}))
    assert read_registry(doc)["lin"]["servers"] == {} and me in read_registry(doc)["lin"]["rejected"]
    commit(doc, server, lambda tx: tx.set(["lin", "servers", me], {**row, "seen": 10.0}))
    assert read_registry(doc)["lin"]["servers"] == {me: {**row, "seen": 10.0}}
