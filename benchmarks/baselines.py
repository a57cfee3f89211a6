"""Comparison rows for the meshd RPC benchmark: plain TCP, bare aioquic, and the Lattica/hivemind anchors.

Every function starts its server in a separate process on 127.0.0.1 (this file re-run with
``--serve KIND``; the child prints ``ready PORT`` on stdout once it listens and exits when its stdin
closes), runs the client in the calling process, is bounded in time, kills its children even on
error, and returns one row::

    {"name", "p50_ms", "p99_ms", "calls_per_s", "up_MBps", "down_MBps", "note"}

p50/p99: sequential unary echo of a 128-byte payload; calls_per_s: the same call with ``inflight``
calls outstanding; up/down: one-way bulk client->server / server->client, MB = 1e6 bytes, timed until
the receiver has everything. Run alone: ``python benchmarks/baselines.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import selectors
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PAYLOAD = 128
CHUNK = 1 << 20
WARMUP = 100
ANCHORS = Path(__file__).resolve().parents[1].parent / "shared" / "anchors"


def _row(name, p50=None, p99=None, cps=None, up=None, down=None, note=""):
    return {"name": name, "p50_ms": p50, "p99_ms": p99, "calls_per_s": cps,
            "up_MBps": up, "down_MBps": down, "note": note}


def _p50_p99_ms(samples):
    """Nearest-rank percentiles in ms, the same rule the anchor scripts use."""
    xs = sorted(samples)
    return [xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] * 1e3 for p in (50, 99)]


# ---------------------------------------------------------------- server child process

class _Server:
    """Context manager: ``python baselines.py --serve KIND ARGS...`` in a child; ``.port`` once ready."""

    def __init__(self, kind, *args, timeout_s=30.0):
        self.cmd = [sys.executable, os.path.abspath(__file__), "--serve", kind, *map(str, args)]
        self.timeout_s = timeout_s

    def __enter__(self):
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self.proc.stdout, selectors.EVENT_READ)
                if not sel.select(self.timeout_s):
                    raise TimeoutError(f"{self.cmd[3]} server not ready after {self.timeout_s}s")
            line = self.proc.stdout.readline().split()
            if line[:1] != ["ready"]:
                raise RuntimeError(f"{self.cmd[3]} server failed to start (rc={self.proc.poll()})")
            self.port = int(line[1])
            return self
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc):
        self.proc.stdin.close()  # the child exits when its stdin closes
        try:
            self.proc.wait(3)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _exit_when_stdin_closes():
    def watch():
        sys.stdin.read()
        os._exit(0)
    threading.Thread(target=watch, daemon=True).start()


def _serve_tcp():
    """Thread per connection; its first byte picks E (length-prefixed echo), U (sink) or D (source)."""
    def handle(conn):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        f = conn.makefile("rb")
        op = f.read(1)
        if op == b"E":
            while len(hdr := f.read(4)) == 4:
                conn.sendall(hdr + f.read(struct.unpack("!I", hdr)[0]))
        elif op in (b"U", b"D"):
            size, got = struct.unpack("!Q", f.read(8))[0], 0
            if op == b"U":
                buf = memoryview(bytearray(CHUNK))
                while got < size and (n := f.readinto(buf[:min(CHUNK, size - got)])):
                    got += n
                conn.sendall(struct.pack("!Q", got))
            else:
                chunk = memoryview(bytes(CHUNK))
                for off in range(0, size, CHUNK):
                    conn.sendall(chunk[:min(CHUNK, size - off)])
                f.read(1)  # the client's acknowledgement
        conn.close()

    ls = socket.create_server(("127.0.0.1", 0))
    print("ready", ls.getsockname()[1], flush=True)
    while True:
        conn, _ = ls.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


# ---------------------------------------------------------------- plain TCP

def tcp_row(n_calls=2000, inflight=64, bulk_bytes=256 << 20, timeout_s=120.0) -> dict:
    """Plain TCP ceiling: 4-byte length + 128 B echo, then bulk both ways, against a threaded server.

    Latency: ``n_calls`` sequential calls on one connection (after 100 warm-up calls). calls/s:
    ``n_calls`` calls pipelined on one connection with ``inflight`` requests outstanding. Bulk:
    ``bulk_bytes`` on a fresh connection each way, timed until the receiver has every byte
    (upload: until the server's byte count comes back). Every socket operation times out after
    ``timeout_s``.
    """
    payload = os.urandom(PAYLOAD)
    req = struct.pack("!I", PAYLOAD) + payload

    with _Server("tcp") as srv:
        def connect(op):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=timeout_s)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(op)
            return s

        with connect(b"E") as s, s.makefile("rb") as f:
            lat = []
            for i in range(WARMUP + n_calls):
                t0 = time.perf_counter()
                s.sendall(req)
                if f.read(len(req)) != req:
                    raise RuntimeError("tcp echo mismatch")
                if i >= WARMUP:
                    lat.append(time.perf_counter() - t0)
            window = min(inflight, n_calls)
            t0 = time.perf_counter()
            s.sendall(req * window)
            for i in range(n_calls):  # one reply in, one more request out: `window` stay in flight
                if f.read(len(req)) != req:
                    raise RuntimeError("tcp pipelined echo mismatch")
                if i + window < n_calls:
                    s.sendall(req)
            cps = n_calls / (time.perf_counter() - t0)

        chunk = memoryview(os.urandom(CHUNK))
        with connect(b"U") as s:
            t0 = time.perf_counter()
            s.sendall(struct.pack("!Q", bulk_bytes))
            for off in range(0, bulk_bytes, CHUNK):
                s.sendall(chunk[:min(CHUNK, bulk_bytes - off)])
            with s.makefile("rb") as f:
                if struct.unpack("!Q", f.read(8))[0] != bulk_bytes:
                    raise RuntimeError("tcp upload: server count mismatch")
            up = bulk_bytes / (time.perf_counter() - t0) / 1e6

        buf = memoryview(bytearray(CHUNK))
        with connect(b"D") as s:
            t0 = time.perf_counter()
            s.sendall(struct.pack("!Q", bulk_bytes))
            got = 0
            while got < bulk_bytes and (n := s.recv_into(buf, min(CHUNK, bulk_bytes - got))):
                got += n
            down = bulk_bytes / (time.perf_counter() - t0) / 1e6
            s.sendall(b"k")
            if got != bulk_bytes:
                raise RuntimeError(f"tcp download: got {got} of {bulk_bytes} bytes")

    p50, p99 = _p50_p99_ms(lat)
    return _row("TCP socket (ceiling)", p50, p99, cps, up, down,
                f"blocking sockets, TCP_NODELAY; calls/s: {inflight} pipelined on 1 connection; "
                f"bulk {bulk_bytes / 2**20:g} MiB")


# ---------------------------------------------------------------- bare aioquic

def _quic_config(is_client, max_datagram_size):
    from aioquic.quic.configuration import QuicConfiguration
    cfg = QuicConfiguration(is_client=is_client, alpn_protocols=["bench"], verify_mode=ssl.CERT_NONE,
                            max_datagram_size=max_datagram_size)
    cfg.max_data = cfg.max_stream_data = 16 << 20  # flow control must not be the limit
    return cfg


def _self_signed():
    import datetime
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    return cert, key


def _serve_aioquic(max_datagram_size):
    """One stream per request; its first byte picks E (echo, FIN), U (sink, reply count) or D (source)."""
    from aioquic.asyncio import QuicConnectionProtocol, serve
    from aioquic.quic.events import StreamDataReceived

    class Proto(QuicConnectionProtocol):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.streams = {}  # stream id -> [op, buffered bytes, byte count]

        def quic_event_received(self, ev):  # aioquic transmits after this returns
            if not isinstance(ev, StreamDataReceived):
                return
            st = self.streams.setdefault(ev.stream_id, [None, bytearray(), 0])
            if st[0] is None and ev.data:
                st[0] = ev.data[:1]
            if st[0] == b"U":
                st[2] += len(ev.data)
            else:
                st[1] += ev.data
            if not ev.end_stream:
                return
            op, buf, count = self.streams.pop(ev.stream_id)
            send = self._quic.send_stream_data
            if op == b"E":
                send(ev.stream_id, bytes(buf[1:]), end_stream=True)
            elif op == b"U":
                send(ev.stream_id, struct.pack("!Q", count - 1), end_stream=True)
            elif op == b"D":
                size, chunk = struct.unpack("!Q", buf[1:9])[0], bytes(CHUNK)
                for off in range(0, size, CHUNK):
                    send(ev.stream_id, chunk[:min(CHUNK, size - off)])
                send(ev.stream_id, b"", end_stream=True)

    async def main():
        cfg = _quic_config(False, max_datagram_size)
        cfg.certificate, cfg.private_key = _self_signed()
        server = await serve("127.0.0.1", 0, configuration=cfg, create_protocol=Proto)
        print("ready", server._transport.get_extra_info("sockname")[1], flush=True)  # no public getter
        await asyncio.Event().wait()  # runs until stdin closes (_exit_when_stdin_closes)

    asyncio.run(main())


def aioquic_row(n_calls=2000, inflight=64, bulk_bytes=256 << 20, max_datagram_size=1200,
                timeout_s=180.0) -> dict:
    """Bare aioquic (asyncio API, no framing layer): one connection, one bidirectional stream per call.

    Unary: client sends 128 B + FIN, server echoes + FIN; ``n_calls`` sequential calls (after 100
    warm-up) for p50/p99, then ``n_calls`` with ``inflight`` concurrent callers for calls/s. Bulk:
    ``bulk_bytes`` on one stream each way (upload: until the server's byte count arrives; download:
    until the client has the FIN). ``max_datagram_size`` is set on both ends; the whole client run
    is cancelled after ``timeout_s``. Uses asyncio.run, so call it from synchronous code.
    """
    import aioquic
    from aioquic.asyncio import QuicConnectionProtocol, connect
    from aioquic.quic.events import StreamDataReceived

    class Client(QuicConnectionProtocol):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.waiting = {}  # stream id -> (future, bytearray or None to only count, [byte count])

        def request(self, *chunks, collect=True):
            """Open a stream, send ``chunks`` + FIN; the future gets the reply (or its size) at FIN."""
            sid = self._quic.get_next_available_stream_id()
            fut = asyncio.get_running_loop().create_future()
            self.waiting[sid] = (fut, bytearray() if collect else None, [0])
            for data in chunks:
                self._quic.send_stream_data(sid, data)
            self._quic.send_stream_data(sid, b"", end_stream=True)
            self.transmit()
            return fut

        def quic_event_received(self, ev):
            if isinstance(ev, StreamDataReceived) and ev.stream_id in self.waiting:
                fut, buf, count = self.waiting[ev.stream_id]
                count[0] += len(ev.data)
                if buf is not None:
                    buf += ev.data
                if ev.end_stream:
                    del self.waiting[ev.stream_id]
                    fut.set_result(bytes(buf) if buf is not None else count[0])

    payload = b"E" + os.urandom(PAYLOAD)
    chunk = os.urandom(CHUNK)
    upload = [b"U"] + [chunk] * (bulk_bytes // CHUNK) + [chunk[:bulk_bytes % CHUNK]]

    async def run(port):
        async with connect("127.0.0.1", port, configuration=_quic_config(True, max_datagram_size),
                           create_protocol=Client) as c:
            lat = []
            for i in range(WARMUP + n_calls):
                t0 = time.perf_counter()
                if await c.request(payload) != payload[1:]:
                    raise RuntimeError("aioquic echo mismatch")
                if i >= WARMUP:
                    lat.append(time.perf_counter() - t0)

            todo = iter(range(n_calls))

            async def caller():
                for _ in todo:
                    if await c.request(payload) != payload[1:]:
                        raise RuntimeError("aioquic concurrent echo mismatch")
            t0 = time.perf_counter()
            await asyncio.gather(*(caller() for _ in range(inflight)))
            cps = n_calls / (time.perf_counter() - t0)

            t0 = time.perf_counter()
            if await c.request(*upload) != struct.pack("!Q", bulk_bytes):
                raise RuntimeError("aioquic upload: server count mismatch")
            up = bulk_bytes / (time.perf_counter() - t0) / 1e6
            t0 = time.perf_counter()
            got = await c.request(b"D" + struct.pack("!Q", bulk_bytes), collect=False)
            down = bulk_bytes / (time.perf_counter() - t0) / 1e6
            if got != bulk_bytes:
                raise RuntimeError(f"aioquic download: got {got} of {bulk_bytes} bytes")
            return lat, cps, up, down

    with _Server("aioquic", max_datagram_size) as srv:
        try:
            lat, cps, up, down = asyncio.run(asyncio.wait_for(run(srv.port), timeout_s))
        except TimeoutError:
            raise TimeoutError(f"aioquic_row did not finish within {timeout_s}s") from None
    p50, p99 = _p50_p99_ms(lat)
    return _row(f"aioquic bare (dgram {max_datagram_size})", p50, p99, cps, up, down,
                f"aioquic {aioquic.__version__}, 1 connection, stream per call, {inflight} concurrent "
                f"callers; bulk {bulk_bytes / 2**20:g} MiB queued at once on 1 stream")


# ---------------------------------------------------------------- anchors

_ANCHORS = [  # name, venv python, script, extra args, (push key, pull key), bulk description
    ("Lattica (anchor)", "/tmp/lat-venv/bin/python", "lattica_bench.py", ["--skip", "dht"],
     ("stream_push", "stream_pull"), "rpc_stream push/pull"),
    ("hivemind (anchor)", "/tmp/hm-venv/bin/python", "hivemind_bench.py", ["--skip", "dht", "--no-averager"],
     ("raw_stream_push", "raw_stream_pull"), "raw p2p stream push/pull"),
]


def _run_anchor(name, python, script, extra, keys, what, timeout_s):
    if not os.path.exists(python):
        return _row(name, note="not set up: run ../shared/anchors/setup")
    with tempfile.TemporaryDirectory(prefix="meshd-anchor-") as tmp:
        out = os.path.join(tmp, "res.json")
        deadline = max(30, int(timeout_s) - 20)  # the script's own limit, under ours
        cmd = [python, str(ANCHORS / script), "--json", out, "--deadline", str(deadline), *extra]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # own process group: killable as a whole
        try:
            log, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return _row(name, note=f"timed out after {timeout_s:.0f}s")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the script and any worker it left behind
            except OSError:
                pass
            proc.wait()
        if not os.path.exists(out):
            return _row(name, note=f"failed rc={proc.returncode}: {log.strip()[-300:]}")
        res = json.load(open(out))
    errors = [res["error"]] if res.get("error") else list(res.get("errors", []))
    seq, conc, xfer = res.get("rpc_seq", {}), res.get("rpc_conc", {}), res.get("xfer", {})
    top = max(conc, key=int) if conc else None
    mbps = lambda k: xfer[k]["median_mib_s"] * (1 << 20) / 1e6 if k in xfer else None  # noqa: E731
    mib = next(iter(xfer.values()), {}).get("size_mib", "?")
    note = (f"{script.split('_')[0]} {res.get('version', '?')}, own netns; calls/s at {top} in flight; "
            f"bulk {mib} MiB {what}, median of {next(iter(xfer.values()), {}).get('reps', '?')}")
    if errors:
        note += "; errors: " + "; ".join(errors)[:300]
    return _row(name, seq.get("p50_ms"), seq.get("p99_ms"), conc[top]["qps"] if top else None,
                mbps(keys[0]), mbps(keys[1]), note)


def anchor_rows(timeout_s=240) -> list[dict]:
    """Run the Lattica and hivemind anchor scripts (RPC + bulk parts only, DHT/averager skipped).

    Each script runs in its venv (/tmp/lat-venv, /tmp/hm-venv), bounded by ``timeout_s`` (then its
    whole process group is killed). Rows map the script's sequential p50/p99, QPS at its highest
    in-flight count, and its 64 MiB stream push/pull medians (MiB/s converted to MB/s). A missing
    venv gives an all-None row saying so; a failure or timeout gives an all-None row with the error.
    """
    rows = []
    for spec in _ANCHORS:
        try:
            rows.append(_run_anchor(*spec, timeout_s=timeout_s))
        except Exception as e:  # e.g. unreadable JSON: still one row per anchor
            rows.append(_row(spec[0], note=f"failed: {type(e).__name__}: {e}"))
    return rows


# ---------------------------------------------------------------- command line

def print_rows(rows):
    """Print rows as a rich table, with each row's note numbered underneath."""
    from rich.console import Console
    from rich.table import Table
    cols = [("p50_ms", 3), ("p99_ms", 3), ("calls_per_s", 0), ("up_MBps", 1), ("down_MBps", 1)]
    table = Table("#", "name", *(c for c, _ in cols), title="RPC baselines (127.0.0.1, 128 B unary; MB = 1e6 B)")
    for i, r in enumerate(rows, 1):
        table.add_row(str(i), r["name"], *("-" if r[c] is None else f"{r[c]:.{d}f}" for c, d in cols))
    console = Console()
    console.print(table)
    for i, r in enumerate(rows, 1):
        console.print(f"  {i}. {r['note']}", highlight=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", nargs="+", metavar=("KIND", "ARG"), help=argparse.SUPPRESS)
    ap.add_argument("--bulk-mib", type=int, default=256)
    ap.add_argument("--no-anchors", action="store_true")
    args = ap.parse_args()
    if args.serve:
        _exit_when_stdin_closes()
        kind = args.serve[0]
        return _serve_tcp() if kind == "tcp" else _serve_aioquic(int(args.serve[1]))
    rows, bulk = [], args.bulk_mib << 20
    jobs = [("TCP", lambda: tcp_row(bulk_bytes=bulk))]
    jobs += [(f"aioquic {d}", lambda d=d: aioquic_row(bulk_bytes=bulk, max_datagram_size=d)) for d in (1200, 16000)]
    if not args.no_anchors:
        jobs.append(("anchors", anchor_rows))
    for label, job in jobs:
        print(f"running {label} ...", file=sys.stderr, flush=True)
        try:
            got = job()
            rows += got if isinstance(got, list) else [got]
        except Exception as e:
            rows.append(_row(label, note=f"failed: {type(e).__name__}: {e}"))
    print_rows(rows)


if __name__ == "__main__":
    main()
