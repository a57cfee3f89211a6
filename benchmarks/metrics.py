"""What counting calls costs: sequential unary calls with the call figures off and on.

    .venv/bin/python benchmarks/metrics.py [--calls 1000] [--rounds 10]

Two nodes in this process on 127.0.0.1 (so the CPU time of both the caller's
and the server's counting is in the figures); rounds alternate off and on, each
first in turn, so that a change in the machine's load hits both alike.  Reports the median over
rounds of the mean wall time and the mean CPU time per call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path[:1] = [str(Path(__file__).resolve().parent.parent)]
import meshd  # noqa: E402
from meshd.rpc.stats import CallStats  # noqa: E402

PAYLOAD = b"x" * 128


async def _echo(arg, ctx):
    return arg


async def _round(call, n: int) -> tuple[float, float]:
    """(wall, CPU) seconds per call over ``n`` sequential calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        await call()
    return (time.perf_counter() - wall) / n, (time.process_time() - cpu) / n


async def measure(calls: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        async with meshd.open_node(f"{tmp}/server", listen="127.0.0.1:0", services=[]) as server, \
                meshd.open_node(f"{tmp}/client", listen="127.0.0.1:0", services=[]) as client:
            server.rpc.register("echo", _echo)
            peer = await client.connect(server.address)

            async def call():
                await client.rpc.call(peer, "echo", PAYLOAD)

            await _round(call, 300)  # warm up
            results: dict[str, list] = {"off": [], "on": []}
            for i in range(rounds):
                for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                    stats = CallStats() if mode == "on" else None
                    server.rpc.observe(stats)
                    client.rpc.observe(stats)
                    results[mode].append(await _round(call, calls))
    return {mode: {"wall_us": statistics.median(w for w, _ in rows) * 1e6,
                   "cpu_us": statistics.median(c for _, c in rows) * 1e6} for mode, rows in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    result = trio.run(measure, args.calls, args.rounds)
    for mode, row in result.items():
        print(f"figures {mode:3}: {row['wall_us']:7.1f} us per call, {row['cpu_us']:7.1f} us CPU per call")
    off, on = result["off"], result["on"]
    print(f"cost: {on['wall_us'] - off['wall_us']:+.1f} us wall ({(on['wall_us'] / off['wall_us'] - 1) * 100:+.1f} %), "
          f"{on['cpu_us'] - off['cpu_us']:+.1f} us CPU ({(on['cpu_us'] / off['cpu_us'] - 1) * 100:+.1f} %)")


if __name__ == "__main__":
    main()
