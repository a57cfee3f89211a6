"""What the benchmark scripts share: logging to stderr and running their parts.

Each script is a list of named parts, each returning table rows.  A part that
fails adds a row saying so and makes the exit code 1; Ctrl-C (and SIGTERM,
which the scripts turn into Ctrl-C so that their cleanup runs) stops the run
with the rows gathered so far and exit code 130.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ANCHORS = Path(__file__).resolve().parent.parent.parent / "shared" / "anchors"


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def stop_on_sigterm() -> None:
    """SIGTERM acts as Ctrl-C: KeyboardInterrupt, which trio delivers safely, so the
    scripts' finally blocks kill every process they started.  SIGINT gets Python's
    own handler back even where it was inherited ignored (a background job)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))


def run_parts(parts: list[tuple[str, Callable[[], list]]], skip: str,
              failed: Callable[[str, str], object], interrupted: object) -> tuple[list, int]:
    """Run each ``(name, part)`` not named in the comma list ``skip``; returns the rows
    and the exit code.  ``failed(name, message)`` is the row for a part that raised;
    ``interrupted`` the row added after Ctrl-C."""
    rows, rc, skipped = [], 0, skip.split(",")
    try:
        for name, part in parts:
            if name in skipped:
                continue
            log(f"[{name}] ...")
            try:
                rows += part()
            except Exception as exc:
                log(f"[{name}] failed: {type(exc).__name__}: {exc}")
                rows.append(failed(name, f"{type(exc).__name__}: {exc}"[:200]))
                rc = 1
    except KeyboardInterrupt:
        log("interrupted: every process this run started has been stopped")
        rows.append(interrupted)
        rc = 130
    return rows, rc


def lab_run_start(args) -> tuple[float, tuple, dict]:
    """Start a NAT-lab benchmark: exit in one line if the lab cannot run here, stop
    cleanly on SIGTERM; the start time, the load average, and the results so far."""
    from natlab import netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"the NAT lab cannot run here: {reason}")
    stop_on_sigterm()
    load = os.getloadavg()
    return time.perf_counter(), load, {"cpus": os.cpu_count(), "args": vars(args), "load_before": load}


def span(values: list[float]) -> str:
    """``LOW-HIGH`` of several runs' values (empty for one run)."""
    return f"{min(values):,.1f}-{max(values):,.1f}" if len(values) > 1 else ""


def save_json(path: str | None, results: dict) -> None:
    """Write ``results`` to ``path`` (if given) as JSON."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)


def run_anchor(python: str, script: Path, extra: list[str], timeout: float) -> dict:
    """Run one of ``../shared/anchors``' scripts with ``extra`` arguments: its JSON results,
    or ``{"error": ...}``.  It runs in its own process group, killed whatever happens."""
    if not os.path.exists(python):
        return {"error": f"not set up ({python} missing): run ../shared/anchors/setup once"}
    if not script.exists():
        return {"error": f"{script} not found"}
    with tempfile.TemporaryDirectory(prefix="meshd-anchor-") as tmp:
        out = os.path.join(tmp, "res.json")
        cmd = [python, str(script), *extra, "--json", out, "--deadline", str(max(30, int(timeout) - 20))]
        log(f"[anchors] {' '.join(cmd)}")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        finally:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)  # the script and any worker it left behind
            proc.wait()
        if not os.path.exists(out):
            return {"error": f"failed rc={proc.returncode}: {output.strip()[-300:]}"}
        with open(out) as f:
            return json.load(f)


_TCP_RECEIVER = r"""
import socket, sys
srv = socket.socket(fileno=int(sys.argv[1]))
srv.settimeout(60); conn, _ = srv.accept(); conn.settimeout(60)
view, total = memoryview(bytearray(4 << 20)), 0
while n := conn.recv_into(view):
    total += n
conn.sendall(total.to_bytes(8, "big"))
"""


def tcp_send_seconds(addr: tuple[str, int], total: int) -> float:
    """Seconds to send ``total`` bytes (16 MiB ``sendall`` from memory) to a receiver at
    ``addr`` that answers with the 8-byte count it got, as ``_TCP_RECEIVER`` does."""
    view = memoryview(os.urandom(16 << 20))
    with socket.create_connection(addr, timeout=60) as sock:
        started = time.perf_counter()
        for sent in range(0, total, len(view)):
            sock.sendall(view[:total - sent])
        sock.shutdown(socket.SHUT_WR)
        got = int.from_bytes(sock.recv(8), "big")
        wall = time.perf_counter() - started
    assert got == total, f"the receiver got {got} of {total} bytes"
    return wall


async def bulk_sink(items, ctx) -> int:
    """A client-streaming RPC handler: the bytes it was sent."""
    total = 0
    async for item in items:
        total += len(item)
    return total


def bulk_source(chunk_size: int):
    """A server-streaming RPC handler sending ``nbytes`` (its argument) in chunks of ``chunk_size``."""
    async def source(nbytes, ctx):
        chunk = b"y" * chunk_size
        for _ in range(nbytes // chunk_size):
            yield chunk
    return source


def tcp_copy_seconds(total: int) -> float:
    """Seconds to send ``total`` bytes over loopback TCP to another process (16 MiB
    ``sendall`` from memory, ``recv_into`` a 4 MiB buffer there): the machine's
    ceiling for moving bytes between processes, measured in the caller's run."""
    with socket.create_server(("127.0.0.1", 0)) as srv:  # the child accepts on it
        proc = subprocess.Popen([sys.executable, "-c", _TCP_RECEIVER, str(srv.fileno())], pass_fds=[srv.fileno()])
        addr = srv.getsockname()
    try:
        return tcp_send_seconds(addr, total)
    finally:
        proc.kill()
        proc.wait(10)
