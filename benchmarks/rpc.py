"""RPC benchmark: meshd against bare aioquic, plain TCP, Lattica and hivemind.

    .venv/bin/python benchmarks/rpc.py [--calls 2000] [--bulk-mib 256] [--no-anchors] [--json FILE]

Two processes on 127.0.0.1: a server process and this one as the client.
Measures unary calls with a 128-byte payload (sequential p50/p99 latency, and
calls per second with 64 in flight) and one-way bulk transfer over one stream
in each direction.  Every other row is measured in this same run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
from rich.console import Console
from rich.table import Table

# The repo, not this folder, comes first: benchmarks/nat.py would shadow the nat package.
_HERE = Path(__file__).resolve().parent
sys.path[:1] = [str(_HERE.parent)]
import meshd  # noqa: E402

sys.path.append(str(_HERE))
import baselines  # noqa: E402
from benchmarks.parts import bulk_sink, bulk_source, save_json  # noqa: E402

CHUNK = 1 << 20
PAYLOAD = b"x" * 128


# --- the server process ---------------------------------------------------------


async def _serve(data_dir: str) -> None:
    async with meshd.open_node(data_dir, listen="127.0.0.1:0") as node:

        async def echo(arg, ctx):
            return arg

        node.rpc.register("echo", echo)
        node.rpc.register("sink", bulk_sink, kind="client_stream")
        node.rpc.register("source", bulk_source(CHUNK))
        print(node.address, flush=True)
        await trio.sleep_forever()


# --- the client side --------------------------------------------------------------


async def _measure(addr: str, n_calls: int, inflight: int, bulk: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        async with meshd.open_node(tmp, listen="127.0.0.1:0") as node:
            peer = await node.connect(addr)
            call = node.rpc.call
            for _ in range(200):  # warm up
                await call(peer, "echo", PAYLOAD)
            lat = []
            for _ in range(n_calls):
                t = time.perf_counter()
                await call(peer, "echo", PAYLOAD)
                lat.append(time.perf_counter() - t)
            lat.sort()

            async def calls_per_second(inflight: int) -> float:
                per_task = max(1, (n_calls * 4) // inflight)

                async def worker():
                    for _ in range(per_task):
                        await call(peer, "echo", PAYLOAD)

                t = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for _ in range(inflight):
                        nursery.start_soon(worker)
                return per_task * inflight / (time.perf_counter() - t)

            rate = await calls_per_second(inflight)
            rate_32 = await calls_per_second(32)

            chunk = b"x" * CHUNK
            t = time.perf_counter()
            got = await node.rpc.client_stream(peer, "sink", (chunk for _ in range(bulk // CHUNK)), timeout=300)
            up = got / (time.perf_counter() - t) / 1e6

            t = time.perf_counter()
            got = 0
            async for item in node.rpc.stream(peer, "source", bulk, timeout=300):
                got += len(item)
            down = got / (time.perf_counter() - t) / 1e6
            assert got == bulk
    return [{
        "name": "meshd RPC (QUIC, 16 KB datagrams on loopback)",
        "p50_ms": lat[len(lat) // 2] * 1e3,
        "p99_ms": lat[int(len(lat) * 0.99)] * 1e3,
        "calls_per_s": rate,
        "up_MBps": up,
        "down_MBps": down,
        "note": f"{inflight} in flight; bulk {bulk >> 20} MiB in 1 MiB messages",
        "lat_ms": [x * 1e3 for x in lat],
    }, {
        "name": "meshd RPC, 32 in flight", "p50_ms": None, "p99_ms": None, "calls_per_s": rate_32,
        "up_MBps": None, "down_MBps": None, "note": "calls/s as the anchors measure it",
    }]


def meshd_rows(n_calls: int, inflight: int, bulk: int) -> list[dict]:
    """Start the server process, measure from here, stop it."""
    with tempfile.TemporaryDirectory() as tmp:
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", tmp], stdout=subprocess.PIPE, text=True
        )
        try:
            addr = server.stdout.readline().strip()
            if not addr:
                raise RuntimeError("benchmark server did not start")
            return trio.run(_measure, addr, n_calls, inflight, bulk)
        finally:
            server.kill()
            server.wait(10)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_table(rows: list[dict]) -> None:
    table = Table(title="unary 128 B and one-way bulk, two processes on 127.0.0.1")
    for col in ("system", "p50 ms", "p99 ms", "calls/s", "up MB/s", "down MB/s", "note"):
        table.add_column(col, justify="left" if col in ("system", "note") else "right")
    for r in rows:
        table.add_row(r["name"], _fmt(r["p50_ms"], 3), _fmt(r["p99_ms"], 3), _fmt(r["calls_per_s"], 0),
                      _fmt(r["up_MBps"], 1), _fmt(r["down_MBps"], 1), r.get("note", ""))
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", metavar="DATA_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--inflight", type=int, default=64)
    parser.add_argument("--bulk-mib", type=int, default=256)
    parser.add_argument("--no-anchors", action="store_true", help="skip Lattica and hivemind")
    parser.add_argument("--json", metavar="FILE", help="also write the rows (and meshd's latencies) as JSON")
    args = parser.parse_args()
    if args.serve:
        trio.run(_serve, args.serve)
        return
    bulk = args.bulk_mib << 20
    rows = meshd_rows(args.calls, args.inflight, bulk)
    rows.append(baselines.aioquic_row(args.calls, args.inflight, bulk, max_datagram_size=1200))
    rows.append(baselines.aioquic_row(args.calls, args.inflight, bulk, max_datagram_size=16000))
    rows.append(baselines.tcp_row(args.calls, args.inflight, bulk))
    if not args.no_anchors:
        rows.extend(baselines.anchor_rows())
    print_table(rows)
    save_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
