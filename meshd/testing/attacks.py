"""Hostile peers for the abuse test: each attack floods a running node until cancelled.

Run as a process of its own (``python -m meshd.testing.attacks ADDR ATTACK[,ATTACK]
SECONDS [--cpu N] [--nice 19]``) so its CPU is not the target's: it pins itself to core N,
prints "under way" once every attack is, runs them together SECONDS more and
prints one JSON object of counters (what it sent, what came back, what was
refused).  ``meshd.testing.abuse`` drives it; docs/security.md says what each
attack checks.

Every attack is ``async def attack(target, stats)``: it adds to the ``stats``
counter as it goes and runs until its cancel scope ends.  The authenticated
ones dial with a fresh identity over a UDP socket of their own, exactly as a
stranger would; the others never finish a handshake.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import socket
import struct
import sys
from collections import Counter
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable

import trio
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from ..address import PeerAddr
from ..identity import Identity
from ..rpc import protocol as P
from ..rpc.client import unary_call
from ..rpc.errors import RpcError
from ..streams import StreamAborted
from ..transport import TransportConfig
from ..transport.connection import ALPN, PeerConnection
from ..transport.endpoint import DialError, Endpoint
from ..wire import encode_frame

Attack = Callable[[PeerAddr, Counter], Awaitable[None]]

_SOURCE_PORTS = 256  # sockets an Initial flood rotates through
_HALF_OPEN_WORKERS = 32
_HALF_OPEN_LISTEN = 1.0  # seconds a half handshake reads the server's flight before abandoning it
_STALLED_STREAMS = 96  # per connection: more than a node lets one open at once (transport.max_streams)
_STALLING_PEERS = 4
_OVERSIZED_WORKERS = 16
_FLOOD_CALLS = 128  # calls in flight from the one flooding peer
_FRESH_WORKERS = 8
_FRESH_HOLD = 2.0  # seconds a fresh identity keeps its connection
_SLOW_PEERS = 2
_SLOW_STREAMS = 64  # per connection
_SLOW_ARG = 1 << 20  # bytes echoed back to a reader that never reads
_CALL_TIMEOUT = 10.0
_MAX_FRAME = 16 << 20


def _ignore(_conn: PeerConnection) -> None:
    """Connection callbacks an attacker has no use for."""


@asynccontextmanager
async def stranger(target: PeerAddr) -> AsyncIterator[PeerConnection]:
    """An authenticated connection to ``target`` under a fresh identity and UDP port.

    Raises DialError if the target refuses it; everything is closed on exit.
    """
    endpoint = Endpoint(Identity.generate(), TransportConfig(), on_connection=_ignore,
                        on_connection_lost=_ignore)
    async with trio.open_nursery() as nursery:
        await nursery.start(endpoint.serve, "127.0.0.1", 0)
        try:
            yield await endpoint.dial(target.host, target.port, target.peer_id)
        finally:
            nursery.cancel_scope.cancel()


async def _udp_socket() -> trio.socket.SocketType:
    """A UDP socket bound to a fresh port on 127.0.0.1."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    await sock.bind(("127.0.0.1", 0))
    return sock


def client_initial(target: PeerAddr) -> bytes:
    """The first datagram a dialing peer sends: a real, padded QUIC Initial
    with a new connection ID, from a client state machine thrown away after."""
    quic = QuicConnection(configuration=QuicConfiguration(is_client=True, alpn_protocols=[ALPN]))
    now = trio.current_time()
    quic.connect((target.host, target.port), now=now)
    return quic.datagrams_to_send(now=now)[0][0]


# --- before any handshake -------------------------------------------------------


def _garbage_datagram(rng: random.Random) -> bytes:
    """Random bytes shaped like each thing the endpoint demultiplexes: STUN (first
    byte 0-3), QUIC short headers, long headers of unknown versions, broken Initials."""
    size = rng.choice((1, 20, 64, 300, 1200, 1400))
    body = rng.randbytes(size)
    first = rng.choice((rng.randrange(4), 0x40 | rng.randrange(64), 0xC0 | rng.randrange(64)))
    return bytes([first]) + body[1:]


async def garbage(target: PeerAddr, stats: Counter) -> None:
    """Random datagrams as fast as one core sends them; counts what comes back."""
    rng = random.Random(7)
    sock = await _udp_socket()
    with sock:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_count_replies, sock, stats, "garbage")
            while True:
                data = _garbage_datagram(rng)
                await sock.sendto(data, (target.host, target.port))
                stats["garbage_datagrams"] += 1
                stats["garbage_bytes_sent"] += len(data)


async def _count_replies(sock: trio.socket.SocketType, stats: Counter, name: str) -> None:
    while True:
        try:
            data = await sock.recv(65536)
        except OSError:
            continue
        stats[f"{name}_replies"] += 1
        stats[f"{name}_bytes_received"] += len(data)


async def initial_flood(target: PeerAddr, stats: Counter) -> None:
    """Fresh QUIC Initials, each from the next of many source ports, never answered."""
    socks = [await _udp_socket() for _ in range(_SOURCE_PORTS)]
    try:
        for n in itertools.count():
            datagram = client_initial(target)
            await socks[n % len(socks)].sendto(datagram, (target.host, target.port))
            stats["initials"] += 1
    finally:
        for sock in socks:
            sock.close()


async def half_handshakes(target: PeerAddr, stats: Counter) -> None:
    """Start handshakes from fresh ports, read the server's flight, then go silent."""
    async with trio.open_nursery() as nursery:
        for _ in range(_HALF_OPEN_WORKERS):
            nursery.start_soon(_half_handshake_loop, target, stats)


async def _half_handshake_loop(target: PeerAddr, stats: Counter) -> None:
    while True:
        with await _udp_socket() as sock:
            datagram = client_initial(target)
            await sock.sendto(datagram, (target.host, target.port))
            stats["half_handshakes"] += 1
            stats["half_bytes_sent"] += len(datagram)
            with trio.move_on_after(_HALF_OPEN_LISTEN):
                await _count_replies(sock, stats, "half")


# --- as an authenticated peer ---------------------------------------------------


async def unfinished_streams(target: PeerAddr, stats: Counter) -> None:
    """Streams whose REQUEST frame never completes, as many as QUIC lets each peer open."""
    async with trio.open_nursery() as nursery:
        for _ in range(_STALLING_PEERS):
            nursery.start_soon(_stall_streams, target, stats)


async def _stall_streams(target: PeerAddr, stats: Counter) -> None:
    async with stranger(target) as conn:
        async with trio.open_nursery() as nursery:
            for _ in range(_STALLED_STREAMS):
                nursery.start_soon(_stall_one, conn, stats)


async def _stall_one(conn: PeerConnection, stats: Counter) -> None:
    """Open a stream, send a frame header promising 64 bytes and 8 of them, wait for the end."""
    while True:
        try:
            stream = conn.open_stream()
            await stream.send_all(struct.pack(">I", 64) + b"\x95" * 8)
            stats["stalled_streams"] += 1
            while await stream.receive_some():
                pass
            stats["stalled_streams_ended_by_server"] += 1
        except StreamAborted:
            stats["stalled_streams_ended_by_server"] += 1
            await trio.sleep(0.1)


async def oversized_frames(target: PeerAddr, stats: Counter) -> None:
    """Frame headers above the frame limit followed by 64 KiB of junk, on many streams."""
    async with stranger(target) as conn:
        async with trio.open_nursery() as nursery:
            for n in range(_OVERSIZED_WORKERS):
                length = 0xFFFFFFFF if n % 2 else _MAX_FRAME + 1
                nursery.start_soon(_oversized_loop, conn, length, stats)


async def _oversized_loop(conn: PeerConnection, length: int, stats: Counter) -> None:
    junk = os.urandom(64 << 10)
    while True:
        stream = conn.open_stream()
        try:
            await stream.send_all(struct.pack(">I", length) + junk, eof=True)
            reply = b""
            while data := await stream.receive_some():
                reply += data
        except StreamAborted:
            stats["oversized_aborted"] += 1
            continue
        stats["oversized_frames"] += 1
        if b"FRAME_TOO_LARGE" in reply:
            stats["oversized_refused"] += 1


async def call_flood(target: PeerAddr, stats: Counter) -> None:
    """One peer keeps ``_FLOOD_CALLS`` pings in flight for as long as it runs."""
    async with stranger(target) as conn:
        async with trio.open_nursery() as nursery:
            for _ in range(_FLOOD_CALLS):
                nursery.start_soon(_ping_loop, conn, stats)


async def _ping_loop(conn: PeerConnection, stats: Counter) -> None:
    async def opener():
        return conn.open_stream()

    payload = b"x" * 128
    while True:
        await _count_call(unary_call(opener, "ping", payload, _CALL_TIMEOUT, _MAX_FRAME), stats, "flood")


async def _count_call(call: Awaitable, stats: Counter, name: str) -> None:
    try:
        await call
        stats[f"{name}_calls"] += 1
    except RpcError as exc:
        stats[f"{name}_{exc.code}"] += 1


async def fresh_identities(target: PeerAddr, stats: Counter) -> None:
    """New identities dial, call once, hold the connection a while and leave."""
    async with trio.open_nursery() as nursery:
        for _ in range(_FRESH_WORKERS):
            nursery.start_soon(_fresh_loop, target, stats)


async def _fresh_loop(target: PeerAddr, stats: Counter) -> None:
    while True:
        try:
            async with stranger(target) as conn:
                stats["fresh_identities"] += 1

                async def opener():
                    return conn.open_stream()

                await _count_call(unary_call(opener, "ping", None, _CALL_TIMEOUT, _MAX_FRAME), stats, "fresh")
                await trio.sleep(_FRESH_HOLD)
        except* DialError:
            stats["fresh_refused"] += 1


async def slow_readers(target: PeerAddr, stats: Counter) -> None:
    """Calls whose 1 MiB answers are never read: the node must hold or drop them."""
    async with trio.open_nursery() as nursery:
        for _ in range(_SLOW_PEERS):
            nursery.start_soon(_slow_peer, target, stats)


async def _slow_peer(target: PeerAddr, stats: Counter) -> None:
    request = encode_frame(P.request_frame("ping", None, P.UNARY, b"s" * _SLOW_ARG))
    async with stranger(target) as conn:
        for _ in range(_SLOW_STREAMS):
            stream = conn.open_stream()
            await stream.send_all(request, eof=True)
            stats["slow_calls"] += 1
            stats["slow_bytes_asked"] += len(request)
        await trio.sleep_forever()


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    """The exceptions in ``group`` and its nested groups."""
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


ATTACKS: dict[str, Attack] = {
    "garbage": garbage,
    "initial_flood": initial_flood,
    "half_handshakes": half_handshakes,
    "unfinished_streams": unfinished_streams,
    "oversized_frames": oversized_frames,
    "call_flood": call_flood,
    "fresh_identities": fresh_identities,
    "slow_readers": slow_readers,
}


# What each attack counts once it is under way (or ``NAME_failed:``, once it gave up).
UNDER_WAY = {
    "garbage": "garbage_datagrams", "initial_flood": "initials", "half_handshakes": "half_handshakes",
    "unfinished_streams": "stalled_streams", "oversized_frames": "oversized_", "call_flood": "flood_",
    "fresh_identities": "fresh_", "slow_readers": "slow_calls",
}
START_WITHIN = 60.0  # seconds the attacks get to be under way (a starved attacker takes long)
UNDER_WAY_LINE = "under way"  # what the process prints then, on a line of its own


class _Counters(Counter):
    """The attacks' counters; ``under_way`` is set once each attack in ``names``
    has counted what it does (or failed)."""

    def __init__(self, names: list[str]):
        super().__init__()
        self._waiting = {name: (UNDER_WAY[name], f"{name}_failed:") for name in names}
        self.under_way = trio.Event()

    def __setitem__(self, key: str, value: int) -> None:
        super().__setitem__(key, value)
        if self._waiting:
            for name in [n for n, prefixes in self._waiting.items() if key.startswith(prefixes)]:
                del self._waiting[name]
            if not self._waiting:
                self.under_way.set()

    def late(self) -> list[str]:
        """The attacks not under way yet."""
        return sorted(self._waiting)


async def run(target: PeerAddr, names: list[str], seconds: float,
              under_way: Callable[[], None] = lambda: None) -> Counter:
    """Run the named attacks together until each is under way (at most
    :data:`START_WITHIN` s), call ``under_way``, then go on for ``seconds``;
    the counters they kept.

    An attack that fails (the target refused or dropped it) is counted as
    ``NAME_failed:ERROR`` and the others go on; one not under way in time as
    ``late:NAME``.
    """
    stats = _Counters(names)

    async def guarded(name: str) -> None:
        try:
            await ATTACKS[name](target, stats)
        except* (DialError, StreamAborted, RpcError, OSError) as group:
            for exc in _leaves(group):
                stats[f"{name}_failed:{type(exc).__name__}"] += 1

    async with trio.open_nursery() as nursery:
        for name in names:
            nursery.start_soon(guarded, name)
        with trio.move_on_after(START_WITHIN):
            await stats.under_way.wait()
        for name in stats.late():
            stats[f"late:{name}"] += 1
        under_way()
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()
    return stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="PEERID@HOST:PORT")
    parser.add_argument("attacks", help=f"comma-separated: {', '.join(ATTACKS)}")
    parser.add_argument("seconds", type=float)
    parser.add_argument("--cpu", type=int, help="pin this process to that core")
    parser.add_argument("--nice", type=int, default=0, help="lower this process's priority by this much")
    args = parser.parse_args(argv)
    names = args.attacks.split(",")
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        parser.error(f"unknown attacks: {', '.join(unknown)}")
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    os.nice(args.nice)
    stats = trio.run(run, PeerAddr.parse(args.target), names, args.seconds, _say_under_way)
    print(json.dumps(dict(stats)), flush=True)


def _say_under_way() -> None:
    sys.stdout.write(f"{UNDER_WAY_LINE}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
