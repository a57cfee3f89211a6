"""One QUIC connection to a peer: aioquic's sans-IO state machine (quic.py) driven by trio.

The endpoint feeds received datagrams in and this object turns aioquic's
events into stream data, authentication and termination, and sends the
path-MTU probes the state machine hands out.  Sending is batched:
application writes mark the connection dirty and one flush per scheduling
round turns everything queued into datagrams.  aioquic's timer is a cancel
scope whose deadline follows ``get_timer()``.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
from collections import Counter
from typing import Callable, Protocol

import trio
from aioquic.quic import events as ev
from aioquic.quic.packet import QuicErrorCode

from ..identity import Identity, PeerId
from ..streams import StreamAborted
from .quic import DatagramSizeChanged, MeshQuicConnection, PathMtuSearchDone
from .stream import CONNECTION_SEND_HIGH_WATER, SEND_HIGH_WATER, QuicCallStream
from .tls import PeerAuthError, peer_id_from_certificate

log = logging.getLogger("meshd.transport")
_INTERNAL_ERROR = "internal error in the QUIC state machine"

ALPN = "meshd/1"
STREAM_CANCELLED = 0x10  # application error code on RESET_STREAM / STOP_SENDING
CLOSE_NORMAL = 0
CLOSE_AUTH_FAILED = 0x101
CLOSE_REPLACED = 0x103
REPLACED_REASON = "replaced by another connection to the same peer"
_MAX_UNSEEN_NAMED = 32  # stream ids a replaced connection's close names as unseen (its reason stays small)
# "(unseen 0 8) (last stream 12)", the first part optional; a stream id is below 2**62, so at
# most 19 digits (a longer number in a peer's reason is not one)
_NEVER_SEEN = re.compile(r"(?:\(unseen (\d{1,19}(?: \d{1,19}){0,%d})\) )?\(last stream (-1|\d{1,19})\)$"
                         % (_MAX_UNSEEN_NAMED - 1))
_MIN_FLUSH_BATCH = 16  # writes; smaller bursts go out in one flush per scheduling round


def unseen_by_peer(reason: str) -> tuple[int | None, frozenset[int]]:
    """What the reason of a peer's close as replaced says it never saw: ``(last, unseen)``,
    our streams above ``last`` and those in ``unseen`` (``(None, {})`` when it says
    nothing of the kind).  Peer data: any text gives an answer, never an error."""
    said = _NEVER_SEEN.search(reason)
    if said is None:
        return None, frozenset()
    unseen, last = said.groups()
    return int(last), frozenset(map(int, unseen.split())) if unseen else frozenset()


class ConnectionOwner(Protocol):
    """What a connection needs of the endpoint that owns it (``Endpoint``).

    ``identity`` is this node's own: a peer that proves the same key is refused.
    """

    identity: Identity
    stats: Counter[str]

    def send_datagram(self, data: bytes, addr: tuple) -> bool:
        """Send one datagram to ``addr`` now; False if the socket refused it as too large (EMSGSIZE)."""

    def route_cid(self, cid: bytes, conn: PeerConnection) -> None:
        """Deliver datagrams addressed to connection ID ``cid`` to ``conn``."""

    def unroute_cid(self, cid: bytes) -> None:
        """Stop delivering datagrams addressed to ``cid``."""

    def connection_established(self, conn: PeerConnection) -> None:
        """``conn`` has authenticated its peer."""

    def connection_terminated(self, conn: PeerConnection) -> None:
        """``conn`` is over; its streams have failed."""


class PeerConnection:
    """A QUIC connection that, once ``established`` is set, knows its ``peer_id``.

    ``on_stream(conn, stream)`` is called for each stream the peer opens.
    """

    def __init__(
        self,
        endpoint: ConnectionOwner,
        quic: MeshQuicConnection,
        remote_addr: tuple,
        *,
        dialed: bool,
        expected_peer: PeerId | None = None,
        stream_window: int,
        connection_window: int,
        keepalive_interval: float,
        send_high_water: int = SEND_HIGH_WATER,
        connection_send_high_water: int = CONNECTION_SEND_HIGH_WATER,
    ):
        self.endpoint = endpoint
        self.quic = quic
        self.remote_addr = remote_addr
        self.dialed = dialed
        self.expected_peer = expected_peer
        self.peer_id: PeerId | None = None
        self.path = "direct"
        self.on_stream: Callable[[PeerConnection, QuicCallStream], None] | None = None
        self.established = trio.Event()
        self.terminated = trio.Event()
        self.close_reason: str | None = None
        self.created_at = trio.current_time()
        self.last_received = self.created_at
        self.last_stream_at = self.created_at  # when a stream last opened or ended
        self._streams: dict[int, QuicCallStream] = {}
        self._last_peer_stream = -1
        self._unseen_peer_streams: set[int] = set()  # below the last, opened with it (RFC 9000 3.2), no bytes yet
        self._idle = trio.lowlevel.ParkingLot()  # wait_idle() callers
        self._blocked: set[QuicCallStream] = set()
        self._stream_window = stream_window
        self.send_high_water = send_high_water  # unacknowledged bytes of a stream beyond which its writer waits
        self.connection_send_high_water = connection_send_high_water  # the same, of all its streams
        self._send_queued: int | None = 0  # bytes queued or unacknowledged on all streams; None: to count again
        self._connection_window = connection_window
        self._consumed_total = 0
        self._consumed: dict[int, int] = {}
        self._keepalive_interval = keepalive_interval
        self._ping_ids = itertools.count()
        self._tx_pending = False
        self._flush_owed = False  # a flush after receiving, left to a task it woke (hold_flush)
        self._tx_writes = 0
        self._tx_streams = 0  # most streams open at once since the last flush
        self._tx_lot = trio.lowlevel.ParkingLot()
        self._timer_at = math.inf
        self._timer_scope: trio.CancelScope | None = None

    def __repr__(self) -> str:
        who = self.peer_id.short() if self.peer_id else "?"
        return f"<PeerConnection {who} {self.remote_addr[0]}:{self.remote_addr[1]}>"

    # --- lifecycle -------------------------------------------------------------

    async def run(self) -> None:
        """Drive timers, flushes and keepalives until the connection terminates.

        If aioquic's state machine fails (a bug, not peer input: that is
        contained where datagrams arrive), this connection ends; the node goes on.
        """
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._flush_loop)
                nursery.start_soon(self._keepalive_loop)
                await self._timer_loop()
                nursery.cancel_scope.cancel()
        except Exception:
            self._internal_error()

    async def _timer_loop(self) -> None:
        while not self.terminated.is_set():
            with trio.CancelScope(deadline=self._timer_at) as scope:
                self._timer_scope = scope
                await trio.sleep_forever()
            self._timer_scope = None
            timer = self.quic.get_timer()
            now = trio.current_time()
            if timer is not None and now >= timer:
                self.quic.handle_timer(now)
                self._process_events()
            self.transmit()

    async def _flush_loop(self) -> None:
        while True:
            if not self._tx_pending:
                await self._tx_lot.park()
            self._tx_pending = False
            self.transmit()

    async def _keepalive_loop(self) -> None:
        while True:
            await trio.sleep(self._keepalive_interval)
            if trio.current_time() - self.last_received >= self._keepalive_interval:
                self.quic.send_ping(next(self._ping_ids))
                self.schedule_transmit()

    def close(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        """Start a clean close: tell the peer and fail every open stream."""
        if self.close_reason is None:
            self.close_reason = reason or "closed locally"
        self.quic.close(error_code=code, reason_phrase=reason)
        self._fail_streams(f"connection closed: {self.close_reason}")
        self.transmit()

    def close_replaced(self) -> None:
        """Close because another connection to the peer replaces this one.

        The reason names the last stream of the peer's that we accepted, and
        those below it that a later one opened but whose bytes never came
        (the first :data:`_MAX_UNSEEN_NAMED`); none of these was seen here, so
        the peer fails them as :class:`~meshd.streams.StreamRefused` and may
        send them again.
        """
        unseen = sorted(self._unseen_peer_streams)[:_MAX_UNSEEN_NAMED]
        named = f" (unseen {' '.join(map(str, unseen))})" if unseen else ""
        self.close(CLOSE_REPLACED, f"{REPLACED_REASON}{named} (last stream {self._last_peer_stream})")

    def _fail_streams(self, reason: str, refused_after: int | None = None,
                      unseen: frozenset[int] = frozenset()) -> None:
        """Fail every open stream; ours above ``refused_after``, or in ``unseen``, as never
        seen by the peer."""
        streams, self._streams = self._streams, {}
        ours = 0 if self.dialed else 1
        for stream in streams.values():
            sid = stream.stream_id
            refused = (refused_after is not None and sid % 4 == ours
                       and (sid > refused_after or sid in unseen))
            stream.peer_aborted(reason, refused=refused)
        self._blocked.clear()
        self._idle.unpark_all()

    # --- datagrams in and out ------------------------------------------------

    def datagram_received(self, data: bytes, addr: tuple, now: float) -> None:
        """Feed one datagram to aioquic and act on what it produced (no sending)."""
        self.last_received = now
        self.quic.receive_datagram(data, addr, now)
        self._send_queued = None  # ACKs may have freed some
        self._process_events()
        if self._blocked:
            self._wake_writers()

    def transmit(self) -> None:
        """Send every datagram aioquic has ready, then re-arm its timer."""
        if self.close_reason == _INTERNAL_ERROR:  # the state machine is not to be trusted
            return
        try:
            self._transmit()
        except Exception:
            self._internal_error()

    def _transmit(self) -> None:
        quic = self.quic
        send = self.endpoint.send_datagram
        self._flush_owed = False
        self._tx_writes = 0
        self._tx_streams = len(self._streams)
        now = trio.current_time()
        datagrams = quic.datagrams_to_send(now=now)
        if not datagrams:
            self.endpoint.stats["idle_flushes"] += 1
        for data, addr in datagrams:
            send(data, addr)
        probe = quic.pmtu_probe(now)
        if probe is not None:
            data, addr, probe = probe
            self.endpoint.stats["pmtu_probes"] += 1
            if not send(data, addr):
                self.endpoint.stats["pmtu_probes_refused"] += 1
                quic.pmtu_probe_refused(probe)
        timer = quic.get_timer()
        timer = math.inf if timer is None else timer
        if timer != self._timer_at:
            self._timer_at = timer
            if self._timer_scope is not None:
                self._timer_scope.deadline = timer

    def hold_flush(self) -> bool:
        """After datagrams arrived: whether to leave the flush to a task they woke
        (then :meth:`flush_held` once it has run).

        True for a connection past its handshake with at most one call open:
        its handler's reply, or its caller's next request, is flushed at once
        as it is written (:meth:`send_data`) and carries the ACK if one is due
        (see ``MeshQuicConnection``), where a flush now would mostly find
        nothing to send and cost aioquic ~55 µs.  With more calls open the flush loop batches the
        writes, and holding their ACKs cut calls per second by a third
        (docs/performance.md).
        """
        self._flush_owed = len(self._streams) <= 1 and self.quic.handshake_confirmed
        return self._flush_owed

    def flush_held(self) -> None:
        """Flush, unless a write has flushed since :meth:`hold_flush` (its datagram carried the ACK)."""
        if self._flush_owed:
            self.transmit()

    def _internal_error(self) -> None:
        """aioquic's state machine raised (a bug, not peer input: that is
        contained where datagrams arrive): end this connection, keep the node."""
        log.exception("QUIC state machine failed on the connection to %s", self.peer_id)
        self.close_reason = _INTERNAL_ERROR
        self._finish(_INTERNAL_ERROR)

    def schedule_transmit(self) -> None:
        """Flush soon, once for many writes; in a large burst, part of it at once.

        Once half as many writes are queued as the most streams open at once
        since the last flush (about half the calls of a burst: a call is one
        write each way), flushing them now lets the peer start on them while
        we produce the rest, instead of both sides taking turns.  Measured in
        docs/performance.md.
        """
        self._tx_writes += 1
        if self._tx_writes >= max(_MIN_FLUSH_BATCH, self._tx_streams // 2):
            self.transmit()
        elif not self._tx_pending:
            self._tx_pending = True
            self._tx_lot.unpark()

    def _process_events(self) -> None:
        quic = self.quic
        streams = self._streams
        while (event := quic.next_event()) is not None:
            kind = type(event)
            if kind is ev.StreamDataReceived:
                stream = streams.get(event.stream_id)
                if stream is None:
                    stream = self._incoming_stream(event.stream_id)
                    if stream is None:
                        continue
                discarded = stream.data_received(event.data, event.end_stream)
                if discarded:
                    self.consumed(stream, discarded)
                    self._stop(stream)
                if stream.finished:
                    self._forget(stream)
            elif kind is ev.StreamReset or kind is ev.StopSendingReceived:
                self._unseen_peer_streams.discard(event.stream_id)  # reset before its first bytes: none come
                stream = streams.get(event.stream_id)
                if stream is not None:
                    if kind is ev.StreamReset:
                        stream.peer_aborted("peer reset the stream")
                        self._forget(stream)
                    else:
                        stream.peer_stopped_sending()
            elif kind is ev.ConnectionIdIssued:
                self.endpoint.route_cid(event.connection_id, self)
            elif kind is ev.ConnectionIdRetired:
                self.endpoint.unroute_cid(event.connection_id)
            elif kind is ev.HandshakeCompleted:
                self._authenticate(event)
            elif kind is ev.ConnectionTerminated:
                self._on_terminated(event)
            elif kind is DatagramSizeChanged or kind is PathMtuSearchDone:
                self._path_mtu_event(event)

    def _incoming_stream(self, stream_id: int) -> QuicCallStream | None:
        """A new stream the peer opened, handed to ``on_stream`` once authenticated."""
        if self.peer_id is None or self.on_stream is None or self.close_reason is not None:
            return None
        if stream_id % 4 != (1 if self.dialed else 0):
            return None  # not a peer-initiated bidirectional stream
        if stream_id > self._last_peer_stream:  # it opened the ones below it too: their bytes may come later
            self._unseen_peer_streams.update(range(  # (each holds one of the MAX_STREAMS the peer may open)
                self._last_peer_stream + 4 if self._last_peer_stream >= 0 else stream_id % 4, stream_id, 4))
            self._last_peer_stream = stream_id
        elif stream_id in self._unseen_peer_streams:  # (after a later one: a lost packet, or written later)
            self._unseen_peer_streams.discard(stream_id)
        else:
            return None  # one seen before, and forgotten once it ended: late bytes of it
        stream = QuicCallStream(self, stream_id)
        self._add_stream(stream)
        self.on_stream(self, stream)
        return stream

    def _authenticate(self, event: ev.HandshakeCompleted) -> None:
        try:
            if event.alpn_protocol != ALPN:
                raise PeerAuthError(f"peer speaks {event.alpn_protocol!r}, not {ALPN!r}")
            peer = peer_id_from_certificate(self.quic.tls._peer_certificate)
            if self.expected_peer is not None and peer != self.expected_peer:
                raise PeerAuthError(
                    f"dialed {self.expected_peer} but the node there is {peer}"
                )
            if peer == self.endpoint.identity.peer_id:
                raise PeerAuthError("connected to ourselves")
        except PeerAuthError as exc:
            log.warning("%s:%s failed authentication: %s", *self.remote_addr[:2], exc)
            self.close(CLOSE_AUTH_FAILED, str(exc))
            return
        self.peer_id = peer
        self.established.set()
        self.endpoint.connection_established(self)

    def _path_mtu_event(self, event: DatagramSizeChanged | PathMtuSearchDone) -> None:
        """Count and log what the path-MTU search did (a settled search and a black hole at info level)."""
        stats = self.endpoint.stats
        where = f"{self.peer_id or '?'} at {_hostport(self.remote_addr)}"
        if isinstance(event, PathMtuSearchDone):
            stats["pmtu_searches_done"] += 1
            log.info("path MTU to %s: datagrams of %d bytes (%d probes, %d lost)",
                     where, event.size, event.probes, event.lost)
        elif event.reason == "black hole":
            stats["pmtu_black_holes"] += 1
            log.info("path MTU to %s: packets of %d bytes stopped arriving, back to %d",
                     where, event.previous, event.size)
        else:
            if event.size > event.previous:
                stats["pmtu_raised"] += 1
            log.debug("datagram size to %s: %d -> %d (%s)", where, event.previous, event.size, event.reason)

    def _on_terminated(self, event: ev.ConnectionTerminated) -> None:
        refused_after, unseen = None, frozenset()
        if event.error_code == CLOSE_REPLACED:
            refused_after, unseen = unseen_by_peer(event.reason_phrase)
        self._finish(event.reason_phrase or _close_reason(event.error_code, self.peer_id),
                     refused_after, unseen)

    def _finish(self, reason: str, refused_after: int | None = None, unseen: frozenset[int] = frozenset()) -> None:
        """The connection is over: fail its streams and tell whoever waits."""
        if self.terminated.is_set():
            return
        if self.close_reason is None:
            self.close_reason = reason
        self._fail_streams(f"connection lost: {self.close_reason}", refused_after, unseen)
        self.terminated.set()
        self.established.set()  # wake anyone waiting for a handshake that will not come
        if self._timer_scope is not None:
            self._timer_scope.cancel()
        self.endpoint.connection_terminated(self)

    # --- used by QuicCallStream ----------------------------------------------

    def open_stream(self) -> QuicCallStream:
        """A new outgoing stream, its id taken now (no bytes are sent until the first
        write): aioquic takes an id only as a stream's first bytes are queued, so two
        streams opened before either wrote (one waited for send room) had the same."""
        if self.close_reason is not None or self.peer_id is None:
            raise StreamAborted(f"connection is not open: {self.close_reason or 'handshaking'}")
        stream_id = self.quic.get_next_available_stream_id()
        self.quic.send_stream_data(stream_id, b"")
        stream = QuicCallStream(self, stream_id)
        self._add_stream(stream)
        return stream

    def _add_stream(self, stream: QuicCallStream) -> None:
        self._streams[stream.stream_id] = stream
        self.last_stream_at = trio.current_time()
        self._tx_streams = max(self._tx_streams, len(self._streams))

    def send_buffered(self, stream_id: int) -> int:
        """Bytes written on the stream and not yet acknowledged by the peer."""
        qs = self.quic._streams.get(stream_id)
        return len(qs.sender._buffer) if qs is not None else 0

    @property
    def send_queued(self) -> int:
        """Bytes written on all streams (ended ones too) and not yet acknowledged by the peer."""
        if self._send_queued is None:
            self._send_queued = sum(len(qs.sender._buffer) for qs in self.quic._streams.values())
        return self._send_queued

    def send_room(self, stream_id: int) -> int:
        """Bytes the stream may queue now (none if 0 or less): under its own high
        water and the connection's."""
        return min(self.send_high_water - self.send_buffered(stream_id),
                   self.connection_send_high_water - self.send_queued)

    def sender_reset(self, stream_id: int) -> bool:
        """aioquic has reset the stream's sending side.

        It does so by itself when STOP_SENDING arrives, so this state, not only
        the events we have seen, decides whether a write may go out.
        """
        qs = self.quic._streams.get(stream_id)
        return qs is not None and qs.sender._reset_error_code is not None

    def send_data(self, stream_id: int, data: bytes, end: bool) -> None:
        """Queue ``data`` on the stream; StreamAborted if aioquic refuses it."""
        try:
            self.quic.send_stream_data(stream_id, data, end)
        except ValueError as exc:  # finished, or a stream the peer may not be sent on
            raise StreamAborted(str(exc)) from None
        if self._send_queued is not None:
            self._send_queued += len(data)
        if end and len(self._streams) <= 1 and not self._tx_pending:
            self.transmit()  # a lone call has nothing to share a packet with: skip the flush hop
        else:
            self.schedule_transmit()

    def wait_for_acks(self, stream: QuicCallStream) -> None:
        self._blocked.add(stream)

    def _wake_writers(self) -> None:
        """Wake the blocked writers whose stream is below its high water, once the
        connection is below half its own (so they do not all wake for every ACK)."""
        if self.send_queued >= self.connection_send_high_water // 2:
            return
        for stream in list(self._blocked):
            if self.send_buffered(stream.stream_id) < self.send_high_water:
                self._blocked.discard(stream)
                stream.writable_again()

    def consumed(self, stream: QuicCallStream, nbytes: int) -> None:
        """The application took ``nbytes``: give the peer that much more credit."""
        quic = self.quic
        self._consumed_total += nbytes
        limit = quic._local_max_data
        target = self._consumed_total + self._connection_window
        if target - limit.value >= self._connection_window // 4:
            limit.value = target
            self.schedule_transmit()
        qs = quic._streams.get(stream.stream_id)
        if qs is not None:
            done = self._consumed.get(stream.stream_id, 0) + nbytes
            self._consumed[stream.stream_id] = done
            target = done + self._stream_window
            if target - qs.max_stream_data_local >= self._stream_window // 4:
                qs.max_stream_data_local = target
                self.schedule_transmit()

    def done_reading(self, stream: QuicCallStream, *, stop_peer: bool) -> None:
        if stop_peer:
            self._stop(stream)
            self.schedule_transmit()
        if stream.finished:
            self._forget(stream)

    def reset_stream(self, stream: QuicCallStream) -> None:
        if self.close_reason is not None:
            return
        self.quic.reset_stream(stream.stream_id, STREAM_CANCELLED)
        self._stop(stream)
        self.schedule_transmit()
        self._forget(stream)

    def _stop(self, stream: QuicCallStream) -> None:
        qs = self.quic._streams.get(stream.stream_id)
        if qs is not None and not qs.receiver.is_finished and not qs.receiver.stop_pending:
            self.quic.stop_stream(stream.stream_id, STREAM_CANCELLED)

    def _forget(self, stream: QuicCallStream) -> None:
        self._streams.pop(stream.stream_id, None)
        self._consumed.pop(stream.stream_id, None)
        self._blocked.discard(stream)
        if not self._streams:
            self.last_stream_at = trio.current_time()
            self._idle.unpark_all()

    async def wait_idle(self) -> None:
        """Return once no stream is open (at once if none is)."""
        while self._streams and not self.terminated.is_set():
            await self._idle.park()

    # --- facts for the node --------------------------------------------------

    @property
    def rtt(self) -> float | None:
        """Smoothed round-trip time in seconds, once measured."""
        rtt = self.quic._loss._rtt_smoothed
        return rtt if rtt > 0 else None

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    @property
    def datagram_size(self) -> int:
        """The largest datagram sent on this connection now (path MTU discovery raises it)."""
        return self.quic.datagram_size


def _hostport(addr: tuple) -> str:
    host = addr[0]
    return f"[{host}]:{addr[1]}" if ":" in str(host) else f"{host}:{addr[1]}"


def _close_reason(code: int, peer: PeerId | None) -> str:
    """Words for a close that came without a reason phrase."""
    if peer is None and code == QuicErrorCode.APPLICATION_ERROR:
        # an application close during the handshake is sent without its reason (RFC 9000 10.2.3)
        return "peer refused the connection (at its connection limit, or shutting down)"
    return f"closed by peer (code {code:#x})"


async def set_when_terminated(conn: PeerConnection, event: trio.Event) -> None:
    """Set ``event`` once ``conn`` has terminated (to tie a helper's lifetime to it)."""
    await conn.terminated.wait()
    event.set()
