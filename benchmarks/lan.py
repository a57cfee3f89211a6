"""Peers at one site: bulk RPC between two hosts behind one NAT, on the LAN path and on the relayed path.

    .venv/bin/python benchmarks/lan.py [--mib 32] [--runs 3] [--json FILE]

Needs root (network namespaces).  One NAT lab: a relay on the public segment
and a site of two hosts behind one router that does not hairpin
(``NatLab.site``).  A meshd node process (the ``nat`` service only) runs in
each namespace, this script in ``--relay`` / ``--serve`` / ``--client`` mode;
every node knows only the relay.  Host b serves two nodes: one with ``[nat]
host_candidates = false`` (today's behaviour: hole punching through the
router's public address fails, the path stays relayed) and one with the
default (the punch exchange carries LAN addresses).  LAN discovery is off
everywhere, so the path comes from punching alone.  Each run a fresh client
on host a calls b by PeerId (through the relay), waits for the path to
settle, then uploads ``--mib`` MiB in 1 MiB messages (client stream) and
downloads as much (server stream); relayed and LAN runs take turns, a new
client (and connection) each time; the median is shown with the range.
"to direct" is the time from the relayed connection to the direct one.
The relay's circuit byte limit is raised for the run (the default, 128 MiB
a circuit, would cut it).  MB = 1e6 bytes; the load average is printed with
the table: the lab shares the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:1] = [str(REPO), str(REPO / "tests" / "support")]  # the repo first: benchmarks/nat.py shadows nat
from benchmarks.parts import bulk_sink, bulk_source, span  # noqa: E402

MiB = 1 << 20
CHUNK = MiB
PORT = 4100
SETTLE = 30.0  # seconds for punching to find the LAN path


# --- inside the namespaces ----------------------------------------------------------


def _config(bootstrap: str | None, host_candidates: bool):
    from meshd import Config
    config = Config()
    config.nat.lan_discovery = False
    config.nat.port_mapping = False
    config.nat.host_candidates = host_candidates
    if bootstrap:
        config.node.bootstrap = [bootstrap]
        config.nat.stun_servers = [bootstrap.partition("@")[2]]
    else:  # the relay
        config.relay.enabled = True
        config.relay.circuit_bytes = 1 << 40
        config.relay.circuit_seconds = 3600.0
    return config


async def _node_forever(data_dir: str, port: int, bootstrap: str | None, host_candidates: bool) -> None:
    """A node that serves the bulk methods; prints its PeerId once it holds a relay reservation."""
    import trio

    import meshd

    config = _config(bootstrap, host_candidates)
    async with meshd.open_node(data_dir, listen=f"0.0.0.0:{port}", config=config, services=["nat"]) as node:
        node.rpc.register("sink", bulk_sink, kind="client_stream")
        node.rpc.register("source", bulk_source(CHUNK))
        relay = node.service("nat").relay
        with trio.fail_after(30):
            while bootstrap and not relay.status()["reserved_at"]:
                await trio.sleep(0.05)
        print(node.peer_id, flush=True)
        await trio.sleep_forever()


async def _client(bootstrap: str, peer_text: str, host_candidates: bool, nbytes: int) -> dict:
    import trio

    import meshd
    from meshd.identity import PeerId

    peer = PeerId.from_string(peer_text)
    with tempfile.TemporaryDirectory() as tmp:
        config = _config(bootstrap, host_candidates)
        async with meshd.open_node(tmp, listen=f"0.0.0.0:{PORT + 1000}", config=config, services=["nat"]) as node:
            with trio.fail_after(30):
                await node.wait_connected(PeerId.from_string(bootstrap.partition("@")[0]))
            first_path = (await node.connection(peer)).path  # through the relay; punching starts
            connected = trio.current_time()
            assert await node.rpc.call(peer, "ping", "first", timeout=30) == "first"
            to_direct = None
            if host_candidates:
                with trio.fail_after(SETTLE):
                    while node.live(peer) is None or node.live(peer).path == "relayed":
                        await node.wait_connection_change(peer)
                to_direct = trio.current_time() - connected
            else:  # let the background punch give up, so the path is the one it will stay
                await node.service("nat").puncher.punch(peer)
            conn = node.live(peer)
            await node.ping(peer)
            chunk = b"x" * CHUNK
            t = time.perf_counter()
            got = await node.rpc.client_stream(peer, "sink", (chunk for _ in range(nbytes // CHUNK)), timeout=600)
            up = got / (time.perf_counter() - t) / 1e6
            assert got == nbytes
            t, got = time.perf_counter(), 0
            async for item in node.rpc.stream(peer, "source", nbytes, timeout=600):
                got += len(item)
            down = got / (time.perf_counter() - t) / 1e6
            assert got == nbytes and node.live(peer) is conn, "the path changed during the run"
            address = next(row["address"] for row in node.peers() if row["peer_id"] == str(peer))
            return {"first_path": first_path, "path": conn.path, "address": address,
                    "rtt_ms": (conn.rtt or 0) * 1000, "to_direct_s": to_direct, "up_MBps": up, "down_MBps": down}


# --- the driver -----------------------------------------------------------------------


def _start(host, args: list[str]) -> str:
    """Start this script in ``host``'s namespace; its first line of output (a PeerId)."""
    proc = host.popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if not line:
        raise RuntimeError(f"{' '.join(args)} did not start (rc {proc.wait()})")
    return line


def lan_rows(nbytes: int, runs: int, results: dict) -> list[dict]:
    from natlab import NatLab
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshd-lan-bench-") as tmp, NatLab() as lab:
        relay_host = lab.public_host("relay")
        a, b = lab.site("office")
        relay_id = _start(relay_host, ["--relay", str(Path(tmp) / "relay"), "--port", str(PORT)])
        bootstrap = f"{relay_id}@{relay_host.address}:{PORT}"
        servers = {lan: _start(b, ["--serve", str(Path(tmp) / f"b{int(lan)}"), "--port", str(PORT + lan),
                                   "--bootstrap", bootstrap, "--lan", str(int(lan))])
                   for lan in (False, True)}
        runs_of: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(runs):
            for lan in (False, True):
                out = a.run([sys.executable, __file__, "--client", servers[lan], "--bootstrap", bootstrap,
                             "--lan", str(int(lan)), "--bytes", str(nbytes)], timeout=900)
                runs_of[lan].append(json.loads(out.stdout.strip().splitlines()[-1]))
        for lan in (False, True):
            res = runs_of[lan]
            results["lan" if lan else "relayed"] = res
            to_direct = [r["to_direct_s"] for r in res if r["to_direct_s"] is not None]
            rows.append({"what": "host candidates on (default)" if lan else "host candidates off (before)",
                         "path": ", ".join(sorted({f"{r['first_path']} -> {r['path']}" for r in res})),
                         "address": ", ".join(sorted({r["address"] for r in res})),
                         "rtt": statistics.median([r["rtt_ms"] for r in res]),
                         "up": statistics.median([r["up_MBps"] for r in res]), "down": statistics.median([r["down_MBps"] for r in res]),
                         "range": [span([r["up_MBps"] for r in res]), span([r["down_MBps"] for r in res])],
                         "to_direct": f"{statistics.median(to_direct):.2f} s" if to_direct else "-"})
        relayed, direct = rows
        direct["note"] = f"x{direct['up'] / relayed['up']:.1f} up, x{direct['down'] / relayed['down']:.1f} down"
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=32, help="MiB each way per run")
    parser.add_argument("--runs", type=int, default=3, help="runs of each, relayed and LAN taking turns")
    parser.add_argument("--json", metavar="FILE", help="also write the rows and raw results as JSON")
    parser.add_argument("--relay", metavar="DATA_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--serve", metavar="DATA_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--client", metavar="PEER_ID", help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=PORT, help=argparse.SUPPRESS)
    parser.add_argument("--lan", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, default=32 * MiB, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.relay or args.serve:
        import trio
        trio.run(_node_forever, args.relay or args.serve, args.port, args.bootstrap, bool(args.lan))
        return 0
    if args.client:
        import trio
        print(json.dumps(trio.run(_client, args.bootstrap, args.client, bool(args.lan), args.bytes)))
        return 0
    return drive(args)


def drive(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from benchmarks.parts import lab_run_start, log, run_parts, save_json

    t0, load0, results = lab_run_start(args)
    rows, rc = run_parts([("site", lambda: lan_rows(args.mib * MiB, args.runs, results))], "",
                         lambda name, message: {"what": "FAILED", "note": message},
                         {"what": "interrupted"})
    load1 = os.getloadavg()
    results.update(rows=rows, wall_s=time.perf_counter() - t0, load_after=load1)
    log(f"load average before {load0[0]:.2f}, after {load1[0]:.2f}")
    table = Table(title=f"Bulk RPC between two hosts behind one NAT, {args.mib} MiB each way, median of "
                        f"{args.runs} ({os.cpu_count()} CPUs, load {load0[0]:.1f} -> {load1[0]:.1f}; "
                        f"{results['wall_s']:.0f} s)")
    for col in ("what", "path (first -> measured)", "peer address", "RTT ms", "up MB/s", "down MB/s",
                "range up; down", "to direct", "note"):
        table.add_column(col, justify="right" if "MB" in col or "RTT" in col else "left")
    for r in rows:
        table.add_row(r["what"], r.get("path", "-"), r.get("address", "-"), _fmt(r.get("rtt")), _fmt(r.get("up")),
                      _fmt(r.get("down")), "; ".join(x for x in r.get("range", []) if x), r.get("to_direct", "-"),
                      r.get("note", ""))
    Console(width=200).print(table)
    save_json(args.json, results)
    return rc


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


if __name__ == "__main__":
    sys.exit(main())
