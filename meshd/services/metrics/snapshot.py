"""One snapshot of a node's figures, as plain data: what ``meshctl top`` shows and
what the Prometheus exporter turns into metrics.

It is taken on the trio thread (the exporter's HTTP thread asks for it through
``trio.from_thread``), so nothing here races the code that updates the figures.
"""

from __future__ import annotations

from typing import Mapping, Protocol

from ...rpc.stats import CallStats
from ...service import Host

PATHS = ("direct", "punched", "relayed")  # always reported, zero or not
CORE = "node"  # what the core's methods (ping, identify) count under


class Figures(Protocol):
    """A service with numbers for the metrics (the root hands in those that have some)."""

    def figures(self) -> dict:
        """Flat ``{key: number or histogram snapshot}``; a key ending ``_total`` only grows."""


def take(host: Host, calls: CallStats | None, sources: Mapping[str, Figures], uptime: float) -> dict:
    """Everything the exporter and ``meshctl top`` read, copied.

    ``calls`` is None until recording starts (then ``rpc`` and ``bytes`` are empty).
    """
    rpc = calls.snapshot() if calls is not None else {"served": {}, "called": {}}
    return {
        "peer_id": str(host.peer_id),
        "uptime_s": uptime,
        "recording": calls is not None,
        "connections": connections_by_path(host),
        "rpc": rpc,
        "bytes": bytes_by_service(rpc),
        "services": {"rpc": serving(host), **{name: source.figures() for name, source in sources.items()}},
    }


def serving(host: Host) -> dict[str, int]:
    """What the node's RPC server holds back: calls waiting for their turn, the bytes
    served calls hold, and the frames refused for passing a byte budget."""
    server = host.rpc.server
    return {"calls_waiting": server.calls_waiting, "held_bytes": server.budget.held,
            "refused_frames_total": server.budget.refused}


def connections_by_path(host: Host) -> dict[str, int]:
    """Open connections counted by path (direct, punched, relayed, ...)."""
    counts = dict.fromkeys(PATHS, 0)
    for peer in host.connected():
        conn = host.live(peer)
        if conn is not None:
            counts[conn.path] = counts.get(conn.path, 0) + 1
    return counts


def service_of(method: str) -> str:
    """The service a method belongs to: its prefix (``dht.find_node`` -> ``dht``), the
    core's (:data:`CORE`) for one with no dot."""
    prefix, dot, _ = method.partition(".")
    return prefix if dot else CORE


def bytes_by_service(rpc: dict) -> dict[str, dict[str, int]]:
    """RPC bytes per service, ``{"in": received, "out": sent}``, served and called together."""
    out: dict[str, dict[str, int]] = {}
    for table in rpc.values():
        for method, entry in table.items():
            moved = out.setdefault(service_of(method), {"in": 0, "out": 0})
            moved["in"] += entry["received"]
            moved["out"] += entry["sent"]
    return out
