"""``meshctl top``: a live view of the node, refreshed in place.

Each refresh takes one snapshot of the node's figures (control method
``metrics.snapshot``) and the connected peers, and shows rates over the time since the
previous one: calls per second by method, bytes per second by service, and
the DHT, documents and fetches.  ``--once`` prints one view (two snapshots
``--interval`` apart) and exits, for scripts and tests; Ctrl-C ends the live
view cleanly.
"""

from __future__ import annotations

import argparse
import time

import meshd

from ..common import command_adder, console, rows_table

TOP_METHODS = 12  # rows of the calls table


def rates(before: dict, after: dict) -> dict:
    """What changed from snapshot ``before`` to ``after``, per second: calls by
    method (with their mean time and errors) busiest first, and bytes by service."""
    seconds = max(after["uptime_s"] - before["uptime_s"], 1e-6)
    calls = []
    for side, table in after["rpc"].items():
        old = before["rpc"].get(side, {})
        for method, entry in table.items():
            count, spent, errors = _delta(entry, old.get(method))
            if count:
                calls.append({"side": side, "method": method, "calls_s": count / seconds,
                              "mean_ms": spent / count * 1000, "errors": errors})
    calls.sort(key=lambda row: -row["calls_s"])
    moved = [{"service": service, "in_s": (now["in"] - before["bytes"].get(service, {}).get("in", 0)) / seconds,
              "out_s": (now["out"] - before["bytes"].get(service, {}).get("out", 0)) / seconds}
             for service, now in sorted(after["bytes"].items())]
    return {"seconds": seconds, "calls": calls, "bytes": moved}


def _delta(entry: dict, old: dict | None) -> tuple[int, float, int]:
    """(calls, seconds spent, errors) of one method since ``old``."""
    count, spent, errors = sum(entry["latency"]["counts"]), entry["latency"]["sum"], sum(entry["errors"].values())
    if old is None:
        return count, spent, errors
    return (count - sum(old["latency"]["counts"]), spent - old["latency"]["sum"],
            errors - sum(old["errors"].values()))


def render(snapshot: dict, change: dict, peers: list[dict]):
    """The view: a summary line, then tables of peers, calls, bytes and the services' figures."""
    from rich.console import Group

    paths = ", ".join(f"{path} {n}" for path, n in snapshot["connections"].items() if n) or "none"
    head = (f"[bold]{snapshot['peer_id'][:16]}…[/]  up {_duration(snapshot['uptime_s'])}  "
            f"connections: {paths}  calls/s {sum(r['calls_s'] for r in change['calls']):.1f}  "
            f"bytes/s in {_size(sum(r['in_s'] for r in change['bytes']))} "
            f"out {_size(sum(r['out_s'] for r in change['bytes']))}")
    peer_rows = [{"peer": p["peer_id"][:16] + "…", "path": p["path"], "rtt_ms": p["rtt_ms"],
                  "streams": p["streams"], "for": _duration(p["connected_s"])} for p in peers]
    call_rows = [{"method": r["method"], "side": r["side"], "calls/s": f"{r['calls_s']:.1f}",
                  "mean ms": f"{r['mean_ms']:.2f}", "errors": r["errors"] or None}
                 for r in change["calls"][:TOP_METHODS]]
    byte_rows = [{"service": r["service"], "in/s": _size(r["in_s"]), "out/s": _size(r["out_s"])}
                 for r in change["bytes"]]
    parts = [head,
             rows_table(f"{len(peers)} peers", peer_rows, ["peer", "path", "rtt_ms", "streams", "for"]),
             rows_table("calls", call_rows, ["method", "side", "calls/s", "mean ms", "errors"]),
             rows_table("bytes", byte_rows, ["service", "in/s", "out/s"])]
    services = snapshot["services"]
    if "dht" in services:
        parts.append(_line("dht", services["dht"], ["contacts", "records", "lookups_total", "lookup_hops"]))
    if "crdt" in services:
        parts.append(_line("crdt", services["crdt"], ["documents", "unsent_changes", "sync_lag_seconds"]))
    if "shards" in services:
        shards = services["shards"]
        parts.append(f"[bold]fetches[/] {shards['fetches']} in progress, "
                     f"{_size(shards['fetch_have_bytes'])} of {_size(shards['fetch_total_bytes'])}, "
                     f"{_size(shards['fetched_bytes_total'])} received since start")
    if not snapshot["recording"]:
        parts.append("[dim]calls are counted from this view's first refresh[/]")
    return Group(*parts)


def _line(title: str, figures: dict, keys: list[str]) -> str:
    """``title key value, ...``; a histogram shows as its mean."""
    shown = []
    for key in keys:
        value = figures[key]
        if isinstance(value, dict):
            count = sum(value["counts"])
            value = f"mean {value['sum'] / count:.2f}" if count else "-"
        shown.append(f"{key.removesuffix('_total')} {value}")
    return f"[bold]{title}[/] " + ", ".join(shown)


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s"


async def _sample(client: meshd.Client) -> tuple[dict, list[dict]]:
    return await client.metrics(), await client.peers()


async def cmd_top(client: meshd.Client, args) -> object:
    before, _ = await _sample(client)
    if args.once:
        time.sleep(args.interval)
        after, peers = await _sample(client)
        change = rates(before, after)
        return {"snapshot": after, "rates": change, "peers": peers}, lambda: console().print(
            render(after, change, peers))
    from rich.live import Live

    try:
        with Live(console=console(), auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                after, peers = await _sample(client)
                live.update(render(after, rates(before, after), peers), refresh=True)
                before = after
    except KeyboardInterrupt:
        pass
    return None, None


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    """``meshctl top``."""
    p = command_adder(sub, common)("top", cmd_top, "a live view: peers and paths, calls/s, bytes/s, documents, fetches")
    p.add_argument("--once", action="store_true", help="print one view and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
