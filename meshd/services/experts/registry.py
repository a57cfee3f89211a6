"""Registry entries: which of an expert's listed servers are still there.

A server refreshes its entry (``seen``, and its load) every ``[experts]
heartbeat`` seconds while it serves; one that died without unserving stops
refreshing, and readers list it as stale instead of as a server.
"""

from __future__ import annotations

HEARTBEAT_LOAD = ("queued", "calls", "rows", "ms_per_batch")  # the load a registry entry carries
STALE_AFTER = 3  # heartbeats an entry may miss before it is listed as stale


def live_servers(servers: object, *, now: float, heartbeat: float) -> tuple[list[str], list[str]]:
    """A registry entry's servers split into (live, stale), each sorted: stale are those
    whose last refresh is more than STALE_AFTER heartbeats old (or unreadable)."""
    live, stale = [], []
    for peer, row in (servers.items() if isinstance(servers, dict) else ()):
        seen = row.get("seen", row.get("since")) if isinstance(row, dict) else None
        fresh = isinstance(seen, (int, float)) and now - seen <= STALE_AFTER * heartbeat
        (live if fresh else stale).append(peer)
    return sorted(live), sorted(stale)
