"""The abuse test's driver: a daemon under attack, and an honest peer timing its calls.

One *phase* starts a fresh daemon pinned to one core, connects an honest
peer, times its pings while the daemon is quiet, then again while an
attacker process (:mod:`meshd.testing.attacks`, pinned to the other core at
the lowest priority) runs the phase's attacks, and reads the daemon's
memory from ``/proc``.
``benchmarks/abuse.py`` prints a table of phases; ``tests/daemon/test_abuse.py``
runs short ones and checks the bounds of docs/security.md.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ..address import PeerAddr
from ..rpc.client import unary_call
from ..rpc.errors import RpcError
from ..streams import StreamAborted
from ..transport.endpoint import DialError
from .attacks import START_WITHIN, UNDER_WAY_LINE, stranger
from .localmesh import Daemon

HONEST_INTERVAL = 0.005  # seconds between the honest peer's calls
HONEST_TIMEOUT = 5.0  # an honest call slower than this counts as failed
_PAYLOAD = b"h" * 128
_MAX_FRAME = 16 << 20
_WARM_UP = 0.5  # seconds the attack runs before the honest calls are timed


@dataclass
class Latencies:
    """The honest peer's calls in one window: seconds per answered call, and failures."""

    seconds: list[float] = field(default_factory=list)
    failed: int = 0

    def quantile(self, q: float) -> float:
        """The ``q`` quantile in milliseconds (nan with no answered call)."""
        if not self.seconds:
            return float("nan")
        ordered = sorted(self.seconds)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Phase:
    """What one phase measured."""

    attacks: list[str]
    quiet: Latencies
    attacked: Latencies
    rss_before_kib: int  # daemon RSS with the honest peer connected, before the attack
    rss_peak_kib: int  # its high-water mark up to the end of the attack
    rss_after_kib: int
    alive: bool  # the daemon still runs when the attack ends
    new_peer_s: float | None  # how long a new honest peer took to connect under attack (None: refused)
    attacker: dict  # the attacker's own counters


def memory_kib(pid: int) -> tuple[int, int]:
    """(resident set size, its high-water mark) of process ``pid`` in KiB (Linux)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


def pin(pid: int, cpu: int) -> None:
    """Pin every thread of process ``pid`` (and so those it starts later) to core ``cpu``."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), {cpu})


def cores() -> tuple[int, int]:
    """(the daemon's core, the attacker's core): two different ones this process may use."""
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[0], allowed[-1]


async def time_calls(target: PeerAddr, seconds: float) -> Latencies:
    """Ping ``target`` every ``HONEST_INTERVAL`` from one connection for ``seconds``.

    A call that fails or takes longer than ``HONEST_TIMEOUT`` counts in ``failed``.
    """
    result = Latencies()
    async with stranger(target) as conn:
        async def opener():
            return conn.open_stream()

        end = trio.current_time() + seconds
        while trio.current_time() < end:
            start = trio.current_time()
            try:
                await unary_call(opener, "ping", _PAYLOAD, HONEST_TIMEOUT, _MAX_FRAME)
                result.seconds.append(trio.current_time() - start)
            except RpcError:
                result.failed += 1
            await trio.sleep_until(start + HONEST_INTERVAL)
    return result


async def time_new_peer(target: PeerAddr, timeout: float = 5.0) -> float | None:
    """Seconds a newcomer with a fresh identity takes to connect and get a ping answered
    (None if refused or not done within ``timeout``)."""
    start = trio.current_time()
    try:
        with trio.move_on_after(timeout):
            async with stranger(target) as conn:
                async def opener():
                    return conn.open_stream()

                await unary_call(opener, "ping", None, timeout, _MAX_FRAME)
                return trio.current_time() - start
    except* (DialError, RpcError, StreamAborted):
        pass
    return None


def start_attacker(target: PeerAddr, attacks: list[str], seconds: float, cpu: int,
                   nice: int = 19) -> subprocess.Popen:
    """The attacker process, pinned to ``cpu`` at ``nice``; it prints its counters when done."""
    cmd = [sys.executable, "-m", "meshd.testing.attacks", str(target), ",".join(attacks),
           str(seconds), "--cpu", str(cpu), "--nice", str(nice)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_under_way(proc: subprocess.Popen, timeout: float) -> str | None:
    """Wait until the attacker says every attack is under way: None, else why not
    (it said something else, or nothing within ``timeout``).  The honest calls
    are timed from then: the attacker spends about a second importing, more on
    a busy machine, before its first packet."""
    fd = proc.stdout.fileno()  # read raw: nothing may sit in the text buffer for communicate()
    if not select.select([fd], [], [], timeout)[0]:
        return f"the attacker was not under way within {timeout:.0f} s"
    said = os.read(fd, len(UNDER_WAY_LINE) + 1)  # one write of under PIPE_BUF bytes: read whole
    return None if said == f"{UNDER_WAY_LINE}\n".encode() else f"the attacker said {said!r}, not that it was under way"


def attacker_counters(proc: subprocess.Popen, timeout: float) -> dict:
    """The JSON counters the attacker printed, or ``{"error": ...}`` if it failed."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": (err or "no output").strip().splitlines()[-1:]}


async def run_phase(attacks: list[str], *, quiet_s: float, attack_s: float,
                    config: dict | None = None, data_root: Path | None = None,
                    attacker_nice: int = 19) -> Phase:
    """One phase against a fresh daemon (see the module docstring).

    The daemon has one core to itself; the attacker, at the lowest priority
    (nice 19), shares the other with this process, so the honest peer's own
    calls wait for no attacker and what they measure is the daemon (on a
    one-core machine all three share it).  The honest calls are timed once
    every attack is under way.  ``attacker_nice`` = 0 is for tests that check
    bounds, not latency: beside another busy process on its core (a test
    suite's other worker), a nice-19 attacker gets almost no CPU.
    """
    daemon_cpu, attacker_cpu = cores()
    own_cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {attacker_cpu})
    with tempfile.TemporaryDirectory(dir=data_root) as tmp:
        daemon = Daemon(Path(tmp) / "target", config=config).start()
        try:
            pin(daemon.proc.pid, daemon_cpu)
            target = daemon.address
            quiet = await time_calls(target, quiet_s)
            rss_before, _ = memory_kib(daemon.proc.pid)
            attacker = start_attacker(target, attacks, _WARM_UP + attack_s, attacker_cpu, attacker_nice)
            not_under_way = await trio.to_thread.run_sync(wait_under_way, attacker, START_WITHIN + 30)
            await trio.sleep(_WARM_UP)
            attacked, new_peer = await _under_attack(target, attack_s)
            counters = await trio.to_thread.run_sync(attacker_counters, attacker, attack_s + 30)
            if not_under_way:
                counters["error"] = not_under_way
            alive = daemon.running
            rss_after, rss_peak = memory_kib(daemon.proc.pid) if alive else (0, 0)
        finally:
            daemon.kill()
            os.sched_setaffinity(0, own_cores)
    return Phase(attacks, quiet, attacked, rss_before, rss_peak, rss_after, alive, new_peer, counters)


async def _under_attack(target: PeerAddr, seconds: float) -> tuple[Latencies, float | None]:
    """The honest peer's calls for ``seconds``, and a newcomer's connect time halfway through."""
    new_peer: list[float | None] = []

    async def newcomer() -> None:
        await trio.sleep(seconds / 2)
        new_peer.append(await time_new_peer(target))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(newcomer)
        calls = await time_calls(target, seconds)
    return calls, new_peer[0]


def run_phase_sync(attacks: list[str], **kwargs) -> Phase:
    """:func:`run_phase` from blocking code (each call in its own trio run)."""
    return trio.run(lambda: run_phase(attacks, **kwargs))


def wall_clock() -> str:
    """The time and the machine's load, for every table that reports numbers."""
    one, five, _ = os.getloadavg()
    return f"{time.strftime('%Y-%m-%d %H:%M')}, load {one:.2f} (1 min) {five:.2f} (5 min), {os.cpu_count()} cores"
