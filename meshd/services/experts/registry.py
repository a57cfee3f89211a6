"""Registry entries: which of an expert's listed servers are there, and still there.

The registry document maps each expert id to ``about`` (what it is) and
``servers``: one row per server, ``tx.set([expert, "servers", PEERID], row)``,
which only that server writes.  The crdt layer lets any writer write any
path, so a row counts only if the peer it is filed under signed it
(:func:`meshd.registry.own_entries`); others are ignored as ``rejected``.

A server refreshes its row (``seen``, and its load) every ``[experts]
heartbeat`` seconds while it serves; one that died without unserving stops
refreshing, and readers list it as stale instead of as a server.
"""

from __future__ import annotations

from crdt.document import Document

from ...registry import own_entries

HEARTBEAT_LOAD = ("queued", "calls", "rows", "ms_per_batch")  # the load a registry entry carries
STALE_AFTER = 3  # heartbeats an entry may miss before it is listed as stale


def read_registry(doc: Document) -> dict[str, dict]:
    """What the registry document lists: expert id -> its entry (``about``, ...) with
    ``servers`` holding only the rows their own server wrote (peer id text -> row) and
    ``rejected`` the sorted keys of the others (another writer's forgery, malformed)."""
    listing = doc.get([]) or {}
    out: dict[str, dict] = {}
    for expert_id, entry in listing.items():
        if isinstance(entry, dict):
            servers, rejected = own_entries(doc, [expert_id, "servers"])
            out[expert_id] = {**entry, "servers": servers, "rejected": rejected}
    return out


def live_servers(servers: object, *, now: float, heartbeat: float) -> tuple[list[str], list[str]]:
    """A registry entry's servers split into (live, stale), each sorted: stale are those
    whose last refresh is more than STALE_AFTER heartbeats old (or unreadable)."""
    live, stale = [], []
    for peer, row in (servers.items() if isinstance(servers, dict) else ()):
        seen = row.get("seen", row.get("since")) if isinstance(row, dict) else None
        fresh = isinstance(seen, (int, float)) and now - seen <= STALE_AFTER * heartbeat
        (live if fresh else stale).append(peer)
    return sorted(live), sorted(stale)


HEALTH = ("ok", "backed-off", "failing", "stale")  # a server's health, best first


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 3)


def describe_servers(live: list[str], stale: list[str], *, measured=None, now: float = 0.0,
                     probes: dict[str, float | str] | None = None) -> dict:
    """What a listing says of one expert's servers: ``peers`` (one map per server:
    ``peer``, ``health``, ``latency_ms`` and where that came from), the row's
    ``health`` (the best of its servers', ``"none"`` without any) and
    ``latency_ms`` (the lowest among the servers that are ok: the one a caller
    tries first), or None.

    ``measured`` is this node's :class:`experts.servers.Servers` for the expert
    (keys: peer ids as text; None if it never called it): a server it called
    has its EWMA as latency (``"calls"``) and its health (``ok``, ``backed-off``,
    ``failing``).  ``probes`` maps a server to the seconds an ``experts.info``
    took just now (``"ping"``: used when no call was measured) or to why it
    failed (then ``failing``, if calls do not say ``backed-off``).  A server listed live
    that nothing speaks against is ``ok``; ``stale`` ones (the registry's) are
    ``stale``.
    """
    probes = probes or {}
    peers = []
    for peer, is_stale in [(p, False) for p in live] + [(p, True) for p in stale]:
        health = measured.health(peer, now) if measured is not None else None
        ewma = measured.ewma(peer) if measured is not None else None
        probe = probes.get(peer)
        entry: dict = {"peer": peer, "latency_ms": _ms(ewma), "latency_from": "calls" if ewma is not None else None}
        if ewma is None and isinstance(probe, float):
            entry |= {"latency_ms": _ms(probe), "latency_from": "ping"}
        if isinstance(probe, str):
            entry["error"] = probe
        if measured is not None and measured.failures(peer):
            entry["failures"] = measured.failures(peer)
        if is_stale:
            health = "stale"
        elif isinstance(probe, str) and health in (None, "ok"):
            health = "failing"  # it did not answer just now: fresher than any call it answered
        elif health is None:
            health = "ok"
        entry["health"] = health
        peers.append(entry)
    best = min((HEALTH.index(p["health"]) for p in peers), default=None)
    fastest = [p["latency_ms"] for p in peers if p["health"] == "ok" and p["latency_ms"] is not None]
    return {"peers": peers, "health": "none" if best is None else HEALTH[best],
            "latency_ms": min(fastest, default=None)}
