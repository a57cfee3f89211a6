"""NAT benchmark: the public/home/symmetric matrix in the namespace lab, N runs per pair.

    .venv/bin/python benchmarks/nat.py [--runs 3] [--pairs home-home,symmetric-home]

Needs root (network namespaces, nftables).  For every ordered pair (a, b) and
run: a fresh lab with a relaying bootstrap node and a second public node (the
two STUN servers), a and b started with only the bootstrap address; then a
calls b by PeerId.  Printed per pair: success rate, the path a ends on, time
to the first RPC (which goes through the relay; p50/p95) and time from the
start of that call to a direct connection (p50/p95, for runs that got one;
an upper bound on the time from relayed to direct).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import trio
from rich.console import Console
from rich.table import Table

# This file is named like the `nat` package: take its folder off the path, put the tests' on.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:1] = [str(_ROOT), str(_ROOT / "tests" / "support")]
from natlab import NatLab, netns_unavailable_reason  # noqa: E402

import meshd  # noqa: E402
from meshd.testing.localmesh import wait_until  # noqa: E402

KINDS = ("public", "home", "symmetric")
DIRECT = ("direct", "punched")
SETTLE = 15.0  # seconds to wait for a direct path after the first call


def _host(lab: NatLab, name: str, kind: str):
    return lab.public_host(name) if kind == "public" else lab.nat_host(name, kind)


async def _measure(a_dir: Path, b_peer: str) -> tuple[float, str, float | None]:
    """(seconds to the first RPC, final path, seconds from its start to a direct path, or None)."""
    async with meshd.connect(a_dir) as a:
        start = time.perf_counter()
        await a.call(b_peer, "ping", "first", timeout=60)
        first = time.perf_counter() - start
        path, direct_after = "relayed", None
        with trio.move_on_after(SETTLE):
            while True:
                row = next((r for r in await a.peers() if r["peer_id"] == b_peer), None)
                if row is not None and row["path"] in DIRECT:
                    path = row["path"]
                    # its age says when it came up, finer than this polling; measured from the
                    # start of the first call (0 if it was up before: AutoNAT dial-backs and
                    # earlier contacts can leave a direct path behind)
                    direct_after = max(0.0, time.perf_counter() - start - row["connected_s"])
                    break
                await trio.sleep(0.1)
        await a.call(b_peer, "ping", "again", timeout=60)
    return first, path, direct_after


def run_pair(kinds: tuple[str, str], runs: int) -> dict:
    results = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp, NatLab() as lab:
            tmp = Path(tmp)
            relay = lab.public_host("relay").daemon(tmp / "relay", config={"relay": {"enabled": True}})
            stun = lab.public_host("stun").daemon(tmp / "stun")
            config = {"nat": {"stun_servers": [relay.udp_address, stun.udp_address]}}
            a = _host(lab, "a", kinds[0]).daemon(tmp / "a", bootstrap=[relay.dial_address], config=config)
            b = _host(lab, "b", kinds[1]).daemon(tmp / "b", bootstrap=[relay.dial_address], config=config)
            try:
                wait_until(lambda: relay.peer_id in b.meshctl("relay")["reserved_at"], 20, "reservation")
                for d in (a, b):
                    wait_until(lambda d=d: d.meshctl("nat")["mapping"], 20, "STUN discovery")
                results.append(trio.run(_measure, a.data_dir, b.peer_id))
            except Exception as exc:  # a failed run counts as a failure, and the next run goes on
                print(f"  {kinds[0]}-{kinds[1]}: run failed: {exc}", file=sys.stderr)
    firsts = sorted(r[0] for r in results)
    directs = sorted(r[2] for r in results if r[2] is not None)
    return {
        "pair": f"{kinds[0]} -> {kinds[1]}",
        "success": f"{len(results)}/{runs}",
        "paths": ", ".join(f"{p} x{n}" for p, n in Counter(r[1] for r in results).items()) or "-",
        "first_p50": _pct(firsts, 50), "first_p95": _pct(firsts, 95),
        "direct_p50": _pct(directs, 50), "direct_p95": _pct(directs, 95),
    }


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pairs", help="comma-separated a-b pairs, e.g. home-home,symmetric-home")
    args = parser.parse_args()
    reason = netns_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"the NAT lab cannot run here: {reason}")
    pairs = [(a, b) for a in KINDS for b in KINDS]
    if args.pairs:
        pairs = [tuple(p.split("-")) for p in args.pairs.split(",")]
    rows = [run_pair(pair, args.runs) for pair in pairs]
    table = Table(title=f"NAT matrix, {args.runs} runs per pair (seconds)")
    for col in ("pair", "success", "final path", "1st RPC p50", "p95", "to direct p50", "p95"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["pair"], r["success"], r["paths"], _fmt(r["first_p50"]), _fmt(r["first_p95"]),
                      _fmt(r["direct_p50"]), _fmt(r["direct_p95"]))
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
