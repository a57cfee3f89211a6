"""A node's one UDP socket: QUIC connections in and out, plus a hook for STUN.

Datagrams are demultiplexed as RFC 7983 does: a first byte of 0-3 is STUN
and goes to ``stun_hook`` (the NAT layer installs it); a QUIC packet goes to
the connection that owns its destination connection ID, and a new Initial
packet starts an incoming connection; anything else is counted and dropped.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import itertools
import logging
import os
import socket
import ssl
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import trio
from aioquic.buffer import Buffer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.packet import (
    QuicPacketType,
    encode_quic_retry,
    encode_quic_version_negotiation,
    pull_quic_header,
)
from aioquic.quic.retry import QuicRetryTokenHandler

from ..identity import Identity, PeerId
from .connection import ALPN, PeerConnection
from .inbox import Datagram, FairInbox
from .stream import CONNECTION_SEND_HIGH_WATER, SEND_HIGH_WATER
from .pmtu import UDP_IPV4_OVERHEAD, UDP_IPV6_OVERHEAD, ladder
from .quic import MeshQuicConnection
from .refusal import refusal
from .tls import identity_certificate

log = logging.getLogger("meshd.transport")

VIRTUAL_HOST = "relay"  # host part of a virtual path's address
_MAX_DIALED = 4096
_MIN_INITIAL = 1200
AIOQUIC_MAX_DATAGRAM = 16000  # aioquic writes frame lengths in 2 bytes: larger datagrams break
# Linux <netinet/in.h>, <linux/in6.h>: Python's socket module lacks most of them
_IP_MTU_DISCOVER, _IP_MTU, _IPV6_MTU_DISCOVER, _IPV6_MTU = 10, 14, 23, 24
_PMTUDISC_PROBE = 3  # set DF, never fragment, ignore the kernel's path-MTU cache
_HOST_CID_LENGTH = 8  # the connection IDs we issue (aioquic's default)
# datagrams read from the socket per wake-up, so a sender faster than recvfrom cannot keep
# the receive loop from processing any (the kernel drops what overflows the socket meanwhile)
_MAX_READS = 4096


class DialError(Exception):
    """A connection could not be established; the message says why."""


@dataclass
class TransportConfig:
    """Transport knobs; every one has a default that suits the open internet."""

    idle_timeout: float = 30.0
    keepalive_interval: float = 10.0
    handshake_timeout: float = 10.0
    max_datagram_size: int = 1200  # every path starts here (QUIC's minimum)
    loopback_datagram_size: int = 16000  # fixed on loopback (0: probe loopback like any path)
    relayed_datagram_size: int = 16000  # fixed on relayed paths, whose datagrams ride a stream (0: 1200)
    pmtud: bool = True  # probe each direct path for larger datagrams (docs/transport.md)
    pmtud_max_datagram_size: int = AIOQUIC_MAX_DATAGRAM  # the largest probed; at most 16000
    stream_window: int = 4 << 20
    connection_window: int = 16 << 20
    max_connections: int = 256
    # of those, from one IP address (one machine, or everyone behind one NAT); beyond, refused during
    # the handshake.  Loopback is not limited unless ``limit_loopback``: processes of this machine
    # (a mesh of daemons on one host, tests, benchmarks) share 127.0.0.1
    max_per_address: int = field(default=32, metadata={"min": 1, "max": 1 << 20})
    limit_loopback: bool = False
    ack_with_data: bool = True  # ACKs ride on data, or go after 2 full-size packets or a delay (False: each at once, alone)
    retry_above: int = 16  # handshakes in progress beyond which a new dialer must first prove its address (Retry)
    close_idle_after: float = 120.0  # close a connection without streams this long (0: never)
    # streams a peer may have open at once on one connection (QUIC MAX_STREAMS; raised as they end).
    # aioquic's own 128 let one peer's calls in flight take everyone's p99 up 5-12x
    # (docs/security.md, "Fairness between peers")
    max_streams: int = field(default=32, metadata={"min": 1, "max": 1 << 20})
    # bytes of one stream sent and not yet acknowledged beyond which its writer waits
    send_high_water: int = field(default=SEND_HIGH_WATER, metadata={"min": 16 << 10, "max": 1 << 30})
    # the same, of all a connection's streams (ended ones too): what a peer that reads none
    # of its answers makes us hold, per connection
    connection_send_high_water: int = field(default=CONNECTION_SEND_HIGH_WATER,
                                            metadata={"min": 16 << 10, "max": 1 << 30})
    # datagrams processed per wake-up: bigger batches delay ACKs and credit (measured: 128 cut bulk to ~110 MB/s)
    recv_batch: int = field(default=16, metadata={"min": 1, "max": 1024})
    # bytes of datagrams read from the socket and waiting to be processed, served a connection at a
    # time (inbox.py); past it the longest queue loses its newest.  One connection's window fits.
    recv_queue: int = field(default=16 << 20, metadata={"min": 64 << 10, "max": 1 << 30})
    socket_buffer: int = field(default=8 << 20, metadata={"min": 64 << 10, "max": 1 << 30})  # UDP SO_RCVBUF/SO_SNDBUF


def _never_fragment(sock: socket.socket) -> None:
    """Linux: set DF on every datagram and never fragment (IP_PMTUDISC_PROBE), so a
    datagram too large for the path is dropped on the way (or refused here with
    EMSGSIZE if the local link is too small): what path MTU probes need."""
    if sys.platform != "linux":
        return
    options = [(socket.IPPROTO_IP, _IP_MTU_DISCOVER)]
    if sock.family == socket.AF_INET6:  # a dual-stack socket sends IPv4 too
        options.append((socket.IPPROTO_IPV6, _IPV6_MTU_DISCOVER))
    for level, option in options:
        try:
            sock.setsockopt(level, option, _PMTUDISC_PROBE)
        except OSError as exc:
            log.debug("cannot set the no-fragment option %s/%s: %s", level, option, exc)


def _route_mtu(addr: tuple) -> int | None:
    """The MTU of the local route to ``addr`` (Linux IP_MTU on a connected socket), or None."""
    if sys.platform != "linux":
        return None
    v6 = ":" in addr[0]
    try:
        with socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(addr)
            if v6:
                return sock.getsockopt(socket.IPPROTO_IPV6, _IPV6_MTU)
            return sock.getsockopt(socket.IPPROTO_IP, _IP_MTU)
    except OSError:
        return None


def _destination_cid(data: bytes) -> bytes:
    """The destination connection ID a QUIC datagram names, without checking the rest
    (for a datagram that is not QUIC: some bytes that name no connection)."""
    if data and data[0] & 0x80:  # long header: version, then the ID's length and the ID
        return data[6:6 + data[5]] if len(data) > 5 else b""
    return data[1:1 + _HOST_CID_LENGTH]


@functools.lru_cache(maxsize=1024)
def is_loopback(host: str) -> bool:
    """Whether ``host`` is an IP literal of this machine's loopback (IPv4-mapped included).

    Cached: the node asks for every call it serves (parsing the text costs ~5 µs).
    """
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


class Endpoint:
    """QUIC over one UDP socket.

    ``on_connection(conn)`` is called when a connection (either direction)
    has authenticated its peer; ``on_connection_lost(conn)`` when it ends.
    """

    def __init__(
        self,
        identity: Identity,
        config: TransportConfig,
        *,
        on_connection: Callable[[PeerConnection], None],
        on_connection_lost: Callable[[PeerConnection], None],
    ):
        self.identity = identity
        self.config = config
        self.on_connection = on_connection
        self.on_connection_lost = on_connection_lost
        self.stun_hook: Callable[[bytes, tuple], None] | None = None
        self.stats: Counter[str] = Counter()
        self._certificate = identity_certificate(identity)
        self._by_cid: dict[bytes, PeerConnection] = {}
        self._cids: dict[PeerConnection, set[bytes]] = {}
        self._sock: socket.socket | None = None
        self._local: tuple[str, int] | None = None  # where the socket is bound, kept past its close
        self._paths: dict[tuple, Callable[[bytes], None]] = {}
        self._retry = QuicRetryTokenHandler()  # address-validation tokens (a fresh key per run)
        self._inbox: FairInbox[PeerConnection | None] = FairInbox(config.recv_queue)
        self.dialed: dict[PeerId, float] = {}  # peers we last sent a direct dial to, and when
        self._path_ids = itertools.count(1)
        self._nursery: trio.Nursery | None = None

    # --- socket ----------------------------------------------------------------

    async def serve(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Bind the socket and run until cancelled; ``started`` once bound."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            for opt, forced in ((socket.SO_RCVBUF, 33), (socket.SO_SNDBUF, 32)):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, forced, self.config.socket_buffer)  # *BUFFORCE, as root
                except OSError:
                    sock.setsockopt(socket.SOL_SOCKET, opt, self.config.socket_buffer)
            _never_fragment(sock)
            sock.setblocking(False)
            sock.bind((host, port))
            self._sock, self._local = sock, sock.getsockname()[:2]
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._receive_loop)
                task_status.started(self.local_address)
        finally:
            self._nursery = None
            for conn in list(self._cids):
                conn.close(reason="node shutting down")
            sock.close()

    @property
    def local_address(self) -> tuple[str, int]:
        """(host, port) the socket is bound to; still answered while the node shuts down
        (a lookup ending then asks for it once the socket is closed)."""
        return self._local

    @property
    def family(self) -> int:
        return self._sock.family

    def send_datagram(self, data: bytes, addr: tuple) -> bool:
        """Send one datagram now; a full socket buffer drops it (QUIC resends).

        Returns False only if the socket refused it as larger than the local
        link can send (EMSGSIZE: the socket never fragments); a path-MTU probe
        that gets this has failed.
        """
        if addr[0] == VIRTUAL_HOST:
            send = self._paths.get(addr)
            if send is not None:
                send(data)
            return True
        try:
            self._sock.sendto(data, addr)
        except BlockingIOError:
            self.stats["send_dropped"] += 1
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:
                self.stats["send_too_big"] += 1
                return False
            self.stats["send_errors"] += 1
            log.debug("sendto %s failed: %s", addr, exc)
        return True

    async def _receive_loop(self) -> None:
        """Take ``recv_batch`` datagrams at a time, process them, send what they made ready; repeat.

        While the socket holds no more than a batch, datagrams are processed as
        they come.  Once it holds more (a backlog, which one fast sender can
        build), what it holds is read into the inbox and served a connection
        at a time (see inbox.py), so other peers' datagrams do not wait behind
        the backlog; the loop then only yields between batches until the inbox
        is empty.  A round starts at most one new connection: its handshake costs
        milliseconds of this thread, so the Initials of a burst wait in the inbox
        and other peers' datagrams are served between them.
        """
        sock, batch, inbox = self._sock, self.config.recv_batch, self._inbox
        while True:
            if inbox:
                await trio.lowlevel.checkpoint()
                self._read_into_inbox(sock)
                taken = inbox.take_round(batch)
            else:
                await trio.lowlevel.wait_readable(sock)
                taken = self._read_socket(sock, batch)
                if len(taken) == batch:  # perhaps a backlog: read it, and serve it fairly
                    for data, addr in taken:
                        self._to_inbox(data, addr)
                    self._read_into_inbox(sock)
                    taken = inbox.take_round(batch)
            now = trio.current_time()
            dirty: dict[PeerConnection, None] = {}
            handshook = False
            for data, addr in taken:
                opens = bool(data and data[0] & 0x80) and _destination_cid(data) not in self._by_cid
                if opens and handshook:  # one handshake a round: the rest wait in the inbox
                    self._to_inbox(data, addr)
                    continue
                conn = self._datagram_received(data, addr, now)
                if conn is not None:
                    dirty[conn] = None
                    handshook = handshook or opens
            held = {conn for conn in dirty if conn.hold_flush()} if self.config.ack_with_data else set()
            if held:  # the tasks these datagrams woke write first (two rounds: trio runs a
                await trio.lowlevel.cancel_shielded_checkpoint()  # round's tasks in either order)
                await trio.lowlevel.cancel_shielded_checkpoint()
            for conn in dirty:
                if conn in held:
                    conn.flush_held()
                else:
                    conn.transmit()

    @staticmethod
    def _read_socket(sock: socket.socket, most: int) -> list[Datagram]:
        """Up to ``most`` datagrams the socket holds, oldest first."""
        read: list[Datagram] = []
        for _ in range(most):
            try:
                read.append(sock.recvfrom(65536))
            except BlockingIOError:
                break
            except OSError:  # e.g. an ICMP error reported on the socket
                continue
        return read

    def _read_into_inbox(self, sock: socket.socket) -> None:
        """Move what the socket holds (at most ``_MAX_READS`` datagrams) into the inbox."""
        for data, addr in self._read_socket(sock, _MAX_READS):
            self._to_inbox(data, addr)

    def _to_inbox(self, data: bytes, addr: tuple) -> None:
        inbox = self._inbox
        dropped = inbox.dropped
        inbox.put(self._by_cid.get(_destination_cid(data)), data, addr)
        if inbox.dropped != dropped:
            self.stats["recv_dropped"] += inbox.dropped - dropped

    def _datagram_received(self, data: bytes, addr: tuple, now: float) -> PeerConnection | None:
        if not data:
            return None
        if data[0] < 4:
            if self.stun_hook is not None:
                self.stun_hook(data, addr)
            else:
                self.stats["stun_unhandled"] += 1
            return None
        conn = self._by_cid.get(_destination_cid(data))  # aioquic checks the rest of the header
        if conn is None:
            try:
                header = pull_quic_header(Buffer(data=data), host_cid_length=_HOST_CID_LENGTH)
            except ValueError:
                self.stats["garbage"] += 1
                return None
            return self._accept(data, header, addr)  # fed the datagram already
        try:
            conn.datagram_received(data, addr, now)
        except Exception:  # aioquic should not raise on peer input; contain it if it does
            log.exception("QUIC state machine failed on a datagram from %s", addr)
            conn.close(reason="internal error")
        return conn

    # --- connections -----------------------------------------------------------

    def _new_quic(self, is_client: bool, addr: tuple, **kwargs) -> MeshQuicConnection:
        """A QUIC state machine for a path to ``addr`` (big datagrams on loopback and relays)."""
        size = self._fixed_size(addr) or self.config.max_datagram_size
        quic = MeshQuicConnection(configuration=self._quic_config(is_client, size),
                                  max_streams=self.config.max_streams, **kwargs)
        if not self.config.ack_with_data:
            quic.ack_at_once()
        return quic

    def _fixed_size(self, addr: tuple) -> int:
        """The datagram size fixed for ``addr``'s kind of path, or 0 (search it).

        Loopback has no path to search.  A relayed path carries each datagram
        as one item of a stream through the relay, which the outer connection
        cuts into its own packets: no size is lost on the way, and the larger
        the datagram, the fewer items, packets and decryptions per byte.
        """
        if addr[0] == VIRTUAL_HOST:
            return self.config.relayed_datagram_size
        return self.config.loopback_datagram_size if is_loopback(addr[0]) else 0

    def _path_limit(self, addr: tuple) -> tuple[int, int]:
        """(the largest datagram worth probing towards ``addr``, its IP+UDP header bytes).

        The limit is the local route's MTU (the interface's, or what the
        kernel learned of the path) less the headers, at most
        ``pmtud_max_datagram_size`` and aioquic's 16,000.
        """
        ip = ipaddress.ip_address(addr[0].split("%")[0])
        v4 = ip.ipv4_mapped if ip.version == 6 else ip
        overhead = UDP_IPV4_OVERHEAD if v4 is not None else UDP_IPV6_OVERHEAD
        limit = min(self.config.pmtud_max_datagram_size, AIOQUIC_MAX_DATAGRAM)
        mtu = _route_mtu((str(v4), addr[1]) if v4 is not None else addr)
        if mtu is not None:
            limit = min(limit, mtu - overhead)
        return limit, overhead

    def _quic_config(self, is_client: bool, datagram_size: int) -> QuicConfiguration:
        cfg = self.config
        return QuicConfiguration(
            is_client=is_client,
            alpn_protocols=[ALPN],
            idle_timeout=cfg.idle_timeout,
            max_datagram_size=datagram_size,
            max_data=cfg.connection_window,
            max_stream_data=cfg.stream_window,
            verify_mode=ssl.CERT_NONE,  # the peer is checked by PeerId after the handshake
            certificate=self._certificate,
            private_key=self.identity.private_key,
        )

    def _new_connection(self, quic: MeshQuicConnection, addr: tuple, *, dialed: bool,
                        expected_peer: PeerId | None) -> PeerConnection:
        cfg = self.config
        conn = PeerConnection(
            self, quic, addr, dialed=dialed, expected_peer=expected_peer,
            stream_window=cfg.stream_window, connection_window=cfg.connection_window,
            keepalive_interval=cfg.keepalive_interval, send_high_water=cfg.send_high_water,
            connection_send_high_water=cfg.connection_send_high_water,
        )
        if addr[0] == VIRTUAL_HOST:
            conn.path = addr[2]
        elif cfg.pmtud and not self._fixed_size(addr):  # a direct path: search it for larger datagrams
            max_size, overhead = self._path_limit(addr)
            quic.enable_pmtud(max_size, ladder(overhead))
        self._cids[conn] = set()
        self.route_cid(quic.host_cid, conn)
        self._nursery.start_soon(self._run_connection, conn)
        return conn

    def _accept(self, data: bytes, header, addr: tuple) -> PeerConnection | None:
        """Start an incoming connection from its first datagram, if that is a real Initial.

        Returns the new connection (already fed ``data``), or None.
        """
        if header.packet_type == QuicPacketType.VERSION_NEGOTIATION:
            return None
        if len(data) < _MIN_INITIAL:  # too small to be a client's first datagram: no answer of any kind
            self.stats["unroutable"] += 1
            return None
        if header.version is not None and header.version not in QuicConfiguration().supported_versions:
            self.send_datagram(
                encode_quic_version_negotiation(
                    source_cid=header.destination_cid,
                    destination_cid=header.source_cid,
                    supported_versions=QuicConfiguration().supported_versions,
                ),
                addr,
            )
            return None
        if header.packet_type != QuicPacketType.INITIAL:
            self.stats["unroutable"] += 1
            return None
        if self._nursery is None:
            return None
        ids = self._validated_ids(header, addr)
        if ids is None:
            return None
        original_cid, retry_cid = ids
        if len(self._cids) >= self.config.max_connections:
            return self._refuse(header, addr, "too many connections", "refused")
        if self._from_crowded_address(addr):
            return self._refuse(header, addr, "too many connections from your address", "refused_address")
        quic = self._new_quic(False, addr, original_destination_connection_id=original_cid,
                              retry_source_connection_id=retry_cid)
        now = trio.current_time()
        quic.receive_datagram(data, addr, now)
        first_flight = quic.datagrams_to_send(now)
        if not first_flight:  # nothing decrypted: a forged or corrupt Initial gets no slot
            self.stats["bad_initial"] += 1
            return None
        conn = self._new_connection(quic, addr, dialed=False, expected_peer=None)
        self.route_cid(header.destination_cid, conn)
        for datagram, to in first_flight:
            self.send_datagram(datagram, to)
        return conn

    def _validated_ids(self, header, addr: tuple) -> tuple[bytes, bytes | None] | None:
        """(original destination CID, Retry source CID) for a new connection, or
        None if the Initial gets none: its token is not one we issued for this
        address in the last 30 s, or, over ``retry_above`` handshakes in
        progress, it has none and we answer with a Retry instead (RFC 9000
        section 8.1.2): one round trip proves the dialer receives at its
        address before it costs us a TLS handshake, so spoofed Initials cost
        one small datagram each.  Relayed paths come through an authenticated
        connection and are never asked."""
        if header.token and addr[0] != VIRTUAL_HOST:
            try:
                original = self._retry.validate_token(address=addr[:2], destination_cid=header.destination_cid,
                                                      token=header.token, now=time.time())
            except ValueError:
                self.stats["bad_token"] += 1
                return None
            return original, header.destination_cid
        if addr[0] == VIRTUAL_HOST or self._handshakes() < self.config.retry_above:
            return header.destination_cid, None
        source_cid = os.urandom(8)
        token = self._retry.create_token(address=addr[:2], original_destination_connection_id=header.destination_cid,
                                         retry_source_connection_id=source_cid, now=time.time())
        self.send_datagram(encode_quic_retry(version=header.version, source_cid=source_cid,
                                             destination_cid=header.source_cid,
                                             original_destination_cid=header.destination_cid,
                                             retry_token=token), addr)
        self.stats["retry_sent"] += 1
        return None

    def _refuse(self, header, addr: tuple, why: str, stat: str) -> None:
        """Refuse the connection ``header`` opens before any TLS: a dialer at a limit costs
        one small datagram (:func:`refusal`), counted in ``stats[stat]``."""
        self.send_datagram(refusal(header, f"refused the connection: {why}"), addr)
        self.stats[stat] += 1

    def _from_crowded_address(self, addr: tuple) -> bool:
        """Whether ``addr``'s IP address holds ``max_per_address`` connections already, so that
        one machine cannot take every slot.  Relayed paths (their address is the relay's
        business) and, by default, loopback are not counted."""
        host = addr[0]
        if host == VIRTUAL_HOST or (not self.config.limit_loopback and is_loopback(host)):
            return False
        return sum(1 for conn in self._cids if conn.remote_addr[0] == host) >= self.config.max_per_address

    def _handshakes(self) -> int:
        """Incoming connections still in their handshake."""
        return sum(1 for conn in self._cids if conn.peer_id is None and not conn.dialed)

    async def dial(self, host: str, port: int, expected_peer: PeerId, timeout: float | None = None) -> PeerConnection:
        """Connect to ``host:port`` and prove that ``expected_peer`` answers there.

        Raises DialError with the reason: unresolvable host, wrong address
        family, handshake timeout, refusal, or a different key at that address.
        """
        if self._nursery is None:
            raise DialError("endpoint is not running")
        addr = await self.resolve(host, port)
        return await self.dial_path(addr, expected_peer, timeout, f"{host}:{port}")

    async def dial_path(self, addr: tuple, expected_peer: PeerId, timeout: float | None = None,
                        name: str | None = None) -> PeerConnection:
        """Connect over a resolved socket address or a virtual path (see ``attach_path``).

        A dial cancelled before its handshake completes is closed, so a path
        that lost a race (another address answered first) never replaces the
        winner later.
        """
        if addr[0] != VIRTUAL_HOST:
            self._note_dial(expected_peer)
        quic = self._new_quic(True, addr)
        conn = self._new_connection(quic, addr, dialed=True, expected_peer=expected_peer)
        quic.connect(addr, now=trio.current_time())
        conn.transmit()
        limit = self.config.handshake_timeout if timeout is None else timeout
        try:
            with trio.move_on_after(limit):
                await conn.established.wait()
        except trio.Cancelled:  # a dial that lost a race (another address answered first) ends here
            if conn.peer_id is None:
                conn.close(reason="dial abandoned")
            raise
        if conn.peer_id is None:
            reason = conn.close_reason or f"no answer within {limit:g} s"
            conn.close(reason="dial abandoned")
            raise DialError(f"{name or addr}: {reason}")
        return conn

    def _note_dial(self, peer: PeerId) -> None:
        """Remember when we last dialed ``peer`` directly (bounded, oldest forgotten first)."""
        self.dialed.pop(peer, None)
        if len(self.dialed) >= _MAX_DIALED:
            self.dialed.pop(next(iter(self.dialed)))
        self.dialed[peer] = trio.current_time()

    # --- virtual paths (relayed connections) ----------------------------------

    def attach_path(self, send: Callable[[bytes], None], label: str = "relayed") -> tuple:
        """A virtual network address whose datagrams go to ``send`` instead of the socket.

        QUIC connections over it (dialed with ``dial_path``, or accepted when an
        Initial arrives through ``path_datagram_received``) are ordinary
        authenticated connections whose ``path`` is ``label``.
        """
        addr = (VIRTUAL_HOST, next(self._path_ids), label)
        self._paths[addr] = send
        return addr

    def detach_path(self, addr: tuple) -> None:
        """Forget a virtual path and close the connections that ran over it."""
        self._paths.pop(addr, None)
        for conn in [c for c in self._cids if c.remote_addr == addr]:
            conn.close(reason="relay circuit closed")

    def path_datagram_received(self, data: bytes, addr: tuple) -> None:
        """A datagram that arrived over the virtual path ``addr``."""
        conn = self._datagram_received(data, addr, trio.current_time())
        if conn is not None:
            conn.transmit()

    async def resolve(self, host: str, port: int) -> tuple:
        """``host:port`` as a socket address this endpoint can send to.

        Raises DialError when the name does not resolve or the family does
        not fit the socket.
        """
        family = self._sock.family
        try:
            infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        except socket.gaierror as exc:
            raise DialError(f"cannot resolve {host!r}: {exc.strerror}") from None
        for fam, _, _, _, sockaddr in infos:
            if fam == family:
                return sockaddr
            if fam == socket.AF_INET and family == socket.AF_INET6:
                return ("::ffff:" + sockaddr[0], sockaddr[1], 0, 0)
        raise DialError(f"{host}:{port} is IPv6 but this node listens on IPv4 only")

    async def _run_connection(self, conn: PeerConnection) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._handshake_deadline, conn)
            await conn.run()
            nursery.cancel_scope.cancel()
        for cid in self._cids.pop(conn, ()):
            if self._by_cid.get(cid) is conn:
                del self._by_cid[cid]

    async def _handshake_deadline(self, conn: PeerConnection) -> None:
        limit = self.config.handshake_timeout
        with trio.move_on_after(limit):
            await conn.established.wait()
        if conn.peer_id is None and conn.close_reason is None:
            conn.close(reason=f"no answer within {limit:g} s")

    def route_cid(self, cid: bytes, conn: PeerConnection) -> None:
        self._by_cid[cid] = conn
        self._cids.setdefault(conn, set()).add(cid)

    def unroute_cid(self, cid: bytes) -> None:
        conn = self._by_cid.pop(cid, None)
        if conn is not None:
            self._cids.get(conn, set()).discard(cid)

    def connection_established(self, conn: PeerConnection) -> None:
        self.on_connection(conn)

    def connection_terminated(self, conn: PeerConnection) -> None:
        if conn.peer_id is not None:
            self.on_connection_lost(conn)

    @property
    def connection_count(self) -> int:
        return len(self._cids)

