"""Bulk lane benchmark: chunks over the TCP lane against QUIC RPC and plain TCP.

    .venv/bin/python benchmarks/lane.py [--big] [--runs 3]

Two processes on 127.0.0.1: a child opens a node holding random 4 MiB chunks
in memory (256 MiB, or 1 GiB with ``--big``) and serves them three ways: a
LaneServer, a server-streaming RPC ``bench.chunks`` over QUIC, and a bare TCP
socket that writes the same bytes.  This process opens a node, connects, and
moves every chunk each way, timed until the last byte is in (MB = 1e6 bytes;
median and best of ``--runs``).  The lane rows also run with both nodes in
this one process, where one GIL serves both ends.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import blake3
import trio
from rich.console import Console
from rich.table import Table

_HERE = Path(__file__).resolve().parent
sys.path[:1] = [str(_HERE.parent)]  # the repo, not this folder (benchmarks/nat.py shadows nat)
import meshd  # noqa: E402
from meshd.lane import LaneServer, open_lane  # noqa: E402

CHUNK = 4 << 20
LANE_METHOD = "bench.lane"


def make_chunks(total: int) -> dict[bytes, bytes]:
    import os
    chunks = (os.urandom(CHUNK) for _ in range(total // CHUNK))
    return {blake3.blake3(c).digest(): c for c in chunks}


async def serve_all(node, chunks: dict[bytes, bytes], nursery: trio.Nursery) -> dict:
    """Start the three servers for ``chunks`` on ``node``; their ports."""
    lane = LaneServer(node, chunks.get, host="127.0.0.1")
    await nursery.start(lane.serve)
    node.rpc.register(LANE_METHOD, lane.issue)  # its own tokens: the node's shards lane serves the store

    async def stream_chunks(ids, ctx):
        for cid in ids:
            yield chunks.get(bytes(cid))
    node.rpc.register("bench.chunks", stream_chunks)

    async def raw(stream: trio.SocketStream):
        async with stream:
            for data in chunks.values():
                await stream.send_all(data)
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    nursery.start_soon(trio.serve_listeners, raw, [listener])
    return {"lane": lane.port, "tcp": listener.socket.getsockname()[1]}


# --- the server process ------------------------------------------------------------


async def _serve(data_dir: str, total: int) -> None:
    chunks = make_chunks(total)
    async with meshd.open_node(data_dir, listen="127.0.0.1:0") as node, trio.open_nursery() as nursery:
        ports = await serve_all(node, chunks, nursery)
        print(json.dumps({"addr": str(node.address), "ids": [c.hex() for c in chunks], **ports}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)  # until the parent closes our stdin
        nursery.cancel_scope.cancel()


# --- the measuring side --------------------------------------------------------------


async def via_lane(node, peer, ids: list[bytes], verify: bool) -> int:
    lane = await open_lane(node, peer, method=LANE_METHOD)
    if lane is None:
        raise RuntimeError("no lane")
    got = 0
    async with lane:
        async for cid, data in lane.fetch(ids):
            if verify and blake3.blake3(data).digest() != cid:
                raise RuntimeError("chunk does not match its id")
            got += len(data)
    return got


async def via_quic(node, peer, ids: list[bytes], verify: bool) -> int:
    got = 0
    async for data in node.rpc.stream(peer, "bench.chunks", ids, timeout=600):
        got += len(data)
    return got


async def via_tcp(port: int) -> int:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    buf = memoryview(bytearray(CHUNK))
    got = 0
    async with stream:
        while n := await stream.socket.recv_into(buf):
            got += n
    return got


async def _timed(runs: int, total: int, make) -> list[float]:
    rates = []
    for _ in range(runs):
        t = time.perf_counter()
        got = await make()
        rates.append(got / (time.perf_counter() - t) / 1e6)
        if got != total:
            raise RuntimeError(f"moved {got} bytes, not {total}")
    return rates


async def measure(addr: str, ids: list[bytes], ports: dict, runs: int, total: int) -> list[tuple]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        async with meshd.open_node(tmp, listen="127.0.0.1:0") as node:
            peer = await node.connect(addr)
            await via_lane(node, peer, ids[:2], False)  # warm up
            for name, fn, note in (
                ("(a) lane, 2 processes", lambda: via_lane(node, peer, ids, False), "TCP + AES-256-GCM"),
                ("(b) QUIC RPC server stream, 2 processes", lambda: via_quic(node, peer, ids, False),
                 "node.rpc.stream, one 4 MiB item per chunk"),
                ("(c) plain TCP, 2 processes", lambda: via_tcp(ports["tcp"]), "the ceiling: no framing, no crypto"),
                ("(d) lane + blake3 check, 2 processes", lambda: via_lane(node, peer, ids, True),
                 "receiver hashes each chunk"),
            ):
                rows.append((name, await _timed(runs, total, fn), note))
    return rows


async def measure_in_process(runs: int, chunks: dict[bytes, bytes]) -> list[tuple]:
    ids, total = list(chunks), sum(map(len, chunks.values()))
    with tempfile.TemporaryDirectory() as tmp:
        async with meshd.open_node(Path(tmp) / "a", listen="127.0.0.1:0") as a, \
                meshd.open_node(Path(tmp) / "b", listen="127.0.0.1:0") as b, trio.open_nursery() as nursery:
            await serve_all(a, chunks, nursery)
            await b.connect(a.address)
            rows = [(f"(e) lane{' + blake3 check' if verify else ''}, 1 process",
                     await _timed(runs, total, lambda: via_lane(b, a.peer_id, ids, verify)),
                     "both nodes share one GIL") for verify in (False, True)]
            nursery.cancel_scope.cancel()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", nargs=2, metavar=("DATA_DIR", "BYTES"), help=argparse.SUPPRESS)
    parser.add_argument("--big", action="store_true", help="move 1 GiB instead of 256 MiB")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.serve:
        trio.run(_serve, args.serve[0], int(args.serve[1]))
        return
    total = (1 << 30) if args.big else (256 << 20)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        child = subprocess.Popen([sys.executable, __file__, "--serve", tmp, str(total)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            info = json.loads(child.stdout.readline() or "null")
            if not info:
                raise RuntimeError("benchmark server did not start")
            ids = [bytes.fromhex(h) for h in info["ids"]]
            rows = trio.run(measure, info["addr"], ids, info, args.runs, total)
        finally:
            child.stdin.close()
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
    rows += trio.run(measure_in_process, args.runs, make_chunks(total))
    table = Table(title=f"{total >> 20} MiB as {total // CHUNK} chunks of 4 MiB, 127.0.0.1, "
                        f"{args.runs} runs ({time.perf_counter() - started:.0f} s in all)")
    for col in ("path", "MB/s median", "MB/s best", "note"):
        table.add_column(col, justify="right" if col.startswith("MB") else "left")
    for name, rates, note in rows:
        table.add_row(name, f"{statistics.median(rates):,.0f}", f"{max(rates):,.0f}", note)
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
