"""Path MTU benchmark: bulk RPC between two lab hosts over 1500- and 9000-byte links, PMTUD off and on.

    .venv/bin/python benchmarks/pmtu.py [--mib 64] [--runs 3] [--mtus 1500,9000] [--skip tcp] [--json FILE]

Needs root (network namespaces).  For each link MTU: a fresh NAT lab with two
public hosts whose veths (and bridge ports) have that MTU; a meshd node
process in each (the core alone, no services), this script in ``--serve`` /
``--client`` mode inside the namespaces.  The client uploads ``--mib`` MiB in
1 MiB messages (client stream) and downloads as much (server stream), first
with ``[transport] pmtud = false`` (every datagram 1200 bytes: the "before"),
then with it on (the default), after both path-MTU searches have settled;
``--runs`` times, off and on taking turns (a new connection, and a new
search, each time), the median shown with the range.  The datagram size
column is what each side's search settled on; CPU ms/MB is both processes'
CPU time per MB moved (steadier than MB/s on a shared machine).  The ceiling
row is plain TCP between the same two namespaces (a Python ``sendall`` /
``recv_into`` pair, like iperf), measured in the same lab.  MB = 1e6 bytes.
The load average is printed with the table: the lab shares the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:1] = [str(REPO), str(REPO / "tests" / "support")]  # the repo first: benchmarks/nat.py shadows nat
from benchmarks.parts import bulk_sink, bulk_source, span, tcp_send_seconds  # noqa: E402

MiB = 1 << 20
CHUNK = MiB
PORT = 4100
SETTLE = 10.0  # seconds to wait for the path-MTU searches


# --- inside the namespaces ----------------------------------------------------------


def _config(pmtud: bool):
    from meshd import Config
    config = Config()
    config.transport.pmtud = pmtud
    return config


async def _serve(data_dir: str, port: int, pmtud: bool) -> None:
    import trio

    import meshd

    async with meshd.open_node(data_dir, listen=f"0.0.0.0:{port}", config=_config(pmtud), services=[]) as node:

        async def path_mtu(arg, ctx):
            """The datagram size this side sends the caller, and whether its search is done."""
            conn = node.live(ctx.peer)
            pmtu = conn.quic.pmtu
            return {"size": conn.datagram_size, "done": pmtu is None or pmtu.state.value == "search_complete"}

        node.rpc.register("sink", bulk_sink, kind="client_stream")
        node.rpc.register("source", bulk_source(CHUNK))
        async def cpu(arg, ctx):
            return [time.process_time(), _udp_drops()]

        node.rpc.register("bench.pmtu", path_mtu)
        node.rpc.register("bench.cpu", cpu)
        print(node.peer_id, flush=True)
        await trio.sleep_forever()


async def _client(addr: str, pmtud: bool, nbytes: int) -> dict:
    import trio

    import meshd

    with tempfile.TemporaryDirectory() as tmp:
        async with meshd.open_node(tmp, listen=f"0.0.0.0:{PORT + 1000}", config=_config(pmtud), services=[]) as node:
            peer = await node.connect(addr)
            conn = node.live(peer)
            with trio.move_on_after(SETTLE):  # both searches settled (or nothing to search)
                while True:
                    theirs = await node.rpc.call(peer, "bench.pmtu", None, timeout=5)
                    ours = conn.quic.pmtu
                    if theirs["done"] and (ours is None or ours.state.value == "search_complete"):
                        break
                    await trio.sleep(0.05)
            async def cpu() -> tuple[float, int]:
                """CPU seconds of both processes so far, and UDP datagrams both namespaces dropped."""
                theirs = await node.rpc.call(peer, "bench.cpu", None, timeout=5)
                return time.process_time() + theirs[0], _udp_drops() + theirs[1]

            chunk = b"x" * CHUNK
            (cpu0, drops0), t = await cpu(), time.perf_counter()
            got = await node.rpc.client_stream(peer, "sink", (chunk for _ in range(nbytes // CHUNK)), timeout=600)
            up = got / (time.perf_counter() - t) / 1e6
            cpu1, drops1 = await cpu()
            up_cpu, up_drops = (cpu1 - cpu0) * 1e3 / (got / 1e6), drops1 - drops0
            assert got == nbytes
            (cpu0, drops0), t = await cpu(), time.perf_counter()
            got = 0
            async for item in node.rpc.stream(peer, "source", nbytes, timeout=600):
                got += len(item)
            down = got / (time.perf_counter() - t) / 1e6
            cpu1, drops1 = await cpu()
            down_cpu, down_drops = (cpu1 - cpu0) * 1e3 / (got / 1e6), drops1 - drops0
            assert got == nbytes
            return {"up_MBps": up, "down_MBps": down, "up_cpu_ms_per_MB": up_cpu, "down_cpu_ms_per_MB": down_cpu,
                    "up_udp_drops": up_drops, "down_udp_drops": down_drops,
                    "size_up": conn.datagram_size, "size_down": theirs["size"]}


def _udp_drops() -> int:
    """UDP datagrams this network namespace dropped for a full receive buffer (/proc/net/snmp)."""
    try:
        lines = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines() if line.startswith("Udp:")]
        return int(dict(zip(lines[0], lines[1]))["RcvbufErrors"])
    except (OSError, KeyError, IndexError, ValueError):
        return 0


def _tcp_serve(port: int) -> None:
    with socket.create_server(("0.0.0.0", port)) as srv:
        print("ready", flush=True)
        conn, _ = srv.accept()
        with conn:
            view, total = memoryview(bytearray(4 * MiB)), 0
            while n := conn.recv_into(view):
                total += n
            conn.sendall(total.to_bytes(8, "big"))


def _tcp_client(host: str, port: int, nbytes: int) -> dict:
    return {"MBps": nbytes / tcp_send_seconds((host, port), nbytes) / 1e6}


# --- the driver -----------------------------------------------------------------------


def _lab_run(host, args: list[str], timeout: float) -> dict:
    out = host.run([sys.executable, __file__, *args], timeout=timeout)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _start(host, args: list[str]) -> str:
    """Start this script in ``host``'s namespace; its first line of output."""
    import subprocess
    proc = host.popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if not line:
        raise RuntimeError(f"{' '.join(args)} did not start (rc {proc.wait()})")
    return line


def mtu_rows(mtu: int, nbytes: int, runs: int, skip: set[str], results: dict) -> list[dict]:
    from natlab import NatLab
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshd-pmtu-bench-") as tmp, NatLab() as lab:
        server, client = lab.public_host("srv", mtu=mtu), lab.public_host("cli", mtu=mtu)
        addrs = {}
        for pmtud in (False, True):  # one server each, both up for all the runs
            port = PORT + pmtud
            peer = _start(server, ["--serve", str(Path(tmp) / f"srv{port}"), "--port", str(port),
                                   "--pmtud", str(int(pmtud))])
            addrs[pmtud] = f"{peer}@{server.address}:{port}"
        runs_of: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(runs):
            for pmtud in (False, True):
                runs_of[pmtud].append(_lab_run(client, ["--client", addrs[pmtud], "--pmtud", str(int(pmtud)),
                                                        "--bytes", str(nbytes)], 900))
        for pmtud in (False, True):
            res = runs_of[pmtud]
            results[f"{mtu}/{'on' if pmtud else 'off'}"] = res
            sizes = sorted({f"{r['size_up']} / {r['size_down']}" for r in res})
            rows.append({"mtu": mtu, "what": f"meshd RPC, PMTUD {'on' if pmtud else 'off'}", "size": ", ".join(sizes),
                         "up": statistics.median([r["up_MBps"] for r in res]), "down": statistics.median([r["down_MBps"] for r in res]),
                         "range": [span([r["up_MBps"] for r in res]), span([r["down_MBps"] for r in res])],
                         "cpu": [statistics.median([r["up_cpu_ms_per_MB"] for r in res]),
                                 statistics.median([r["down_cpu_ms_per_MB"] for r in res])]})
        off, on = rows[-2], rows[-1]
        on["note"] = f"x{on['up'] / off['up']:.1f} up, x{on['down'] / off['down']:.1f} down"
        if "tcp" not in skip:
            _start(server, ["--tcp-serve", "--port", str(PORT + 10)])
            res = _lab_run(client, ["--tcp-client", server.address, "--port", str(PORT + 10),
                                    "--bytes", str(4 * nbytes)], 300)
            results[f"{mtu}/tcp"] = res
            rows.append({"mtu": mtu, "what": "plain TCP, same veths (ceiling)", "size": "-",
                         "up": res["MBps"], "down": None, "note": f"{4 * nbytes // MiB} MiB one way, once"})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="MiB each way per run")
    parser.add_argument("--runs", type=int, default=3, help="runs of each, off and on taking turns")
    parser.add_argument("--mtus", default="1500,9000", help="comma list of link MTUs")
    parser.add_argument("--skip", default="", help="comma list of: tcp")
    parser.add_argument("--json", metavar="FILE", help="also write the rows and raw results as JSON")
    parser.add_argument("--serve", metavar="DATA_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--client", metavar="ADDR", help=argparse.SUPPRESS)
    parser.add_argument("--tcp-serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tcp-client", metavar="HOST", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=PORT, help=argparse.SUPPRESS)
    parser.add_argument("--pmtud", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, default=64 * MiB, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        import trio
        trio.run(_serve, args.serve, args.port, bool(args.pmtud))
        return 0
    if args.client:
        import trio
        print(json.dumps(trio.run(_client, args.client, bool(args.pmtud), args.bytes)))
        return 0
    if args.tcp_serve:
        _tcp_serve(args.port)
        return 0
    if args.tcp_client:
        print(json.dumps(_tcp_client(args.tcp_client, args.port, args.bytes)))
        return 0
    return drive(args)


def drive(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from benchmarks.parts import lab_run_start, log, run_parts, save_json

    t0, load0, results = lab_run_start(args)
    skip = {s for s in args.skip.split(",") if s}
    if unknown := skip - {"tcp"}:
        raise SystemExit(f"--skip: unknown part(s) {', '.join(sorted(unknown))}")
    parts = [(f"mtu {m}", lambda m=int(m): mtu_rows(m, args.mib * MiB, args.runs, skip, results))
             for m in args.mtus.split(",")]
    rows, rc = run_parts(parts, "",
                         lambda name, message: {"mtu": name, "what": "FAILED", "size": "-", "up": None,
                                                "down": None, "note": message},
                         {"mtu": "-", "what": "interrupted", "size": "-", "up": None, "down": None})
    load1 = os.getloadavg()
    results.update(rows=rows, wall_s=time.perf_counter() - t0, load_after=load1)
    log(f"load average before {load0[0]:.2f}, after {load1[0]:.2f}")
    table = Table(title=f"Bulk RPC between two lab namespaces, {args.mib} MiB each way, median of {args.runs} "
                        f"({os.cpu_count()} CPUs, load {load0[0]:.1f} -> {load1[0]:.1f}; "
                        f"{results['wall_s']:.0f} s)")
    for col in ("link MTU", "what", "datagram bytes up / down", "up MB/s", "down MB/s", "range up; down",
                "CPU ms/MB up; down", "note"):
        table.add_column(col, justify="right" if "MB" in col else "left")
    for r in rows:
        cpu = "; ".join(f"{c:.1f}" for c in r["cpu"]) if "cpu" in r else ""
        table.add_row(str(r["mtu"]), r["what"], r["size"], _fmt(r["up"]), _fmt(r["down"]),
                      "; ".join(x for x in r.get("range", []) if x), cpu, r.get("note", ""))
    Console(width=200).print(table)
    save_json(args.json, results)
    return rc


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


if __name__ == "__main__":
    sys.exit(main())
