"""aioquic's QUIC state machine with the changes meshd needs (sans-IO, like aioquic itself).

``MeshQuicConnection`` is driven by ``PeerConnection`` (connection.py, the
trio shell) through aioquic's own calls (``receive_datagram``,
``datagrams_to_send``, ``get_timer``, ``handle_timer``, ``next_event``) plus
``pmtu_probe`` / ``pmtu_probe_refused`` for path MTU discovery, whose search
itself is ``PathMtu`` (pmtu.py).  These overrides use aioquic internals:
``constraints.txt`` pins aioquic 1.7.2 and ``pyproject.toml`` caps it below 1.8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from aioquic import tls as quic_tls
from aioquic.buffer import Buffer
from aioquic.quic import events as ev
from aioquic.quic.connection import END_STATES, Limit, QuicConnection, QuicConnectionState
from aioquic.quic.packet import QuicFrameType, QuicPacketType, pull_quic_transport_parameters
from aioquic.quic.packet_builder import QuicDeliveryState, QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketPacer, QuicPacketRecovery

from .pmtu import PathMtu, Probe, State

PROBE_TIMEOUT_PTOS = 3  # a path-MTU probe unanswered for this many PTOs is lost
_BIG_ACK_LOOKUPS = 32  # packets looked at per ACK for the largest acknowledged full-size one


@dataclass
class DatagramSizeChanged(ev.QuicEvent):
    """The path-MTU search changed the connection's datagram size, for ``reason``:
    ``"probe"`` (a probe of ``size`` was acknowledged), ``"black hole"`` (full-size
    packets stopped arriving: back to base) or ``"new path"`` (the peer's address changed)."""

    size: int
    previous: int
    reason: str


@dataclass
class PathMtuSearchDone(ev.QuicEvent):
    """The path-MTU search has settled on ``size`` after ``probes`` probes, ``lost`` of them lost."""

    size: int
    probes: int
    lost: int


class _PmtuRecovery(QuicPacketRecovery):
    """aioquic's loss recovery, telling the path-MTU search (``pmtu``) what became of the
    connection's own packets, so it can notice a black hole (see ``PathMtu.packets_lost``).

    Probes are not among them: they are registered neither in flight nor ack-eliciting.
    """

    pmtu: PathMtu | None = None
    on_black_hole: Callable[[], None] | None = None

    def on_ack_received(self, *, ack_rangeset, ack_delay, now, space) -> None:  # type: ignore[override]
        pmtu = self.pmtu
        if pmtu is not None and space.is_application_data:
            big = _largest_big_acked(ack_rangeset, space.sent_packets, pmtu.base)
            if big is not None:
                pmtu.packet_acked(*big)
        super().on_ack_received(ack_rangeset=ack_rangeset, ack_delay=ack_delay, now=now, space=space)

    def _on_packets_lost(self, *, packets, space, **kwargs) -> None:  # type: ignore[override]
        packets = list(packets)
        pmtu = self.pmtu
        black_hole = False
        if pmtu is not None and space.is_application_data:
            black_hole = pmtu.packets_lost([(p.packet_number, p.sent_bytes) for p in packets if p.in_flight])
        super()._on_packets_lost(packets=packets, space=space, **kwargs)
        if black_hole and self.on_black_hole is not None:
            self.on_black_hole()


PACING_BURST = 0.002  # seconds of its rate a paced sender may send at once, to catch up on a late timer


class _TimerPacer(QuicPacketPacer):
    """aioquic's pacer, letting a sender catch up on up to ``PACING_BURST`` of its rate at once.

    aioquic's pacer lets out at most 16 packets at once, then asks to be woken one
    packet's time later.  trio wakes no sooner than about a millisecond later (epoll's
    timeout is in whole milliseconds; 1.09 ms measured here for any shorter sleep), so
    a sender clocked by that timer sent 16 packets a millisecond whatever its rate: at
    1,200-1,472-byte datagrams, uploads of 16-45 MB/s where the same pair now moves
    48-60, at up to twice the CPU per MB (docs/transport.md, "Pacing").
    """

    def update_rate(self, congestion_window: int, smoothed_rtt: float) -> None:
        super().update_rate(congestion_window, smoothed_rtt)
        self.bucket_max = max(self.bucket_max, PACING_BURST)


def _largest_big_acked(ack_rangeset, sent_packets: dict, base: int) -> tuple[int, int] | None:
    """``(number, size)`` of the newest in-flight packet larger than ``base`` that
    ``ack_rangeset`` acknowledges, looking at no more than a few packets from the top."""
    lookups = _BIG_ACK_LOOKUPS
    for r in reversed(ack_rangeset):
        for number in range(r.stop - 1, r.start - 1, -1):
            packet = sent_packets.get(number)
            if packet is not None and packet.in_flight and packet.sent_bytes > base:
                return number, packet.sent_bytes
            lookups -= 1
            if lookups == 0:
                return None
    return None


ACK_DELAY = 0.001  # seconds an ACK waits for data to ride on, from when it may ride, then goes alone
ACK_RIDE_GAP = 0.002  # a pending ACK rides on the stream data we send this long or more after our last ACK
MAX_STREAMS = 128  # streams a peer may have open at once on a connection (aioquic's own limit)


class MeshQuicConnection(QuicConnection):
    """aioquic's connection with the changes meshd needs.

    * A server asks the client for its certificate, so both sides prove a key.
    * Receive credit (MAX_DATA, MAX_STREAM_DATA) grows as the application
      reads, not as data arrives, so an unread stream stops its sender.  The
      PeerConnection raises the limits in ``consumed``; aioquic's own
      doubling rule is neutralised here by hiding the amounts it looks at.
    * ACKs ride on data: one is sent at once after two full-size packets'
      worth of bytes received, a PING, or while a stream of ours waits for
      stream credit; with the next stream data we send if no ACK left within
      ``ACK_RIDE_GAP``; else alone ``ACK_DELAY`` after it could have ridden
      (see ``receive_datagram``).
    * Pacing catches up on a timer that fired late (``_TimerPacer``).
    * Path MTU discovery (``enable_pmtud``, ``pmtu_probe``): aioquic has no
      probe of its own, so a probe is a 1-RTT packet of PING and PADDING built
      here at the probed size and registered with aioquic's loss recovery
      neither in flight nor ack-eliciting: its ACK or loss reaches the PING's
      delivery handler, yet its loss shrinks no congestion window, arms no
      PTO and makes nothing be retransmitted (RFC 9000 section 14.4).
    """

    def __init__(self, *args, max_streams: int = MAX_STREAMS, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Streams the peer may have open at once, each way (aioquic fixes 128; it raises
        # the limit by one as each ends).  Read when the transport parameters are built.
        self._local_max_streams_bidi = Limit(QuicFrameType.MAX_STREAMS_BIDI, "max_streams_bidi", max_streams)
        self._local_max_streams_uni = Limit(QuicFrameType.MAX_STREAMS_UNI, "max_streams_uni", max_streams)
        self._ack_delay = ACK_DELAY
        self._unacked = 0  # bytes received since our last ACK; above 0 exactly while a 1-RTT ACK is pending
        self._ack_with_data = True
        self._ack_sent_at = -math.inf  # when our last 1-RTT ACK left
        self._clock = 0.0  # the latest time aioquic was told of
        # The same loss recovery aioquic builds, plus what the path-MTU search needs to hear,
        # and a pacer that lets a late timer catch up.
        config = self._configuration
        self._loss = _PmtuRecovery(
            congestion_control_algorithm=config.congestion_control_algorithm,
            initial_rtt=config.initial_rtt,
            max_datagram_size=self._max_datagram_size,
            peer_completed_address_validation=not self._is_client,
            quic_logger=self._quic_logger,
            send_probe=self._send_probe,
            logger=self._logger,
        )
        self._loss._pacer = _TimerPacer(max_datagram_size=self._max_datagram_size)
        self._loss.on_black_hole = lambda: self._pmtu_update("black hole")
        self.pmtu: PathMtu | None = None  # the search, once started
        self._pmtu_limit: tuple[int, tuple[int, ...]] | None = None  # (max size, ladder) while enabled
        self._pmtu_addr = None  # the path the search is about
        self._pmtu_done = False  # the search had settled when last looked at
        self._peer_max_udp_payload: int | None = None

    # --- path MTU discovery ----------------------------------------------------

    @property
    def datagram_size(self) -> int:
        """The largest datagram this connection sends now."""
        return self._max_datagram_size

    def enable_pmtud(self, max_size: int, ladder: tuple[int, ...] = ()) -> None:
        """Search the path for datagrams up to ``max_size`` once the handshake is done
        (``ladder``: the sizes to try first, see ``PathMtu``)."""
        if max_size > self._max_datagram_size:
            self._pmtu_limit = (max_size, ladder)

    def pmtu_probe(self, now: float) -> tuple[bytes, tuple, Probe] | None:
        """``(datagram, address, probe)`` if a path-MTU probe is due now, else None.

        Send the datagram; if the socket refuses it as too large, say so with
        ``pmtu_probe_refused``.
        """
        if self._pmtu_limit is None or not self._can_probe():
            return None
        addr = self._network_paths[0].addr
        if self.pmtu is None or addr != self._pmtu_addr:
            self._start_pmtu(addr, now)
        probe = self.pmtu.probe(now, PROBE_TIMEOUT_PTOS * self._loss.get_probe_timeout())
        if probe is None:
            return None
        return self._build_probe(probe, now), addr, probe

    def pmtu_probe_refused(self, probe: Probe) -> None:
        """The socket refused ``probe`` (EMSGSIZE): the local link cannot send that size."""
        if self.pmtu is not None:
            self.pmtu.probe_refused(probe)
            self._pmtu_update("probe")

    def _can_probe(self) -> bool:
        return (
            self._state is QuicConnectionState.CONNECTED
            and self._handshake_complete
            and not self._close_pending
            and self._network_paths[0].is_validated
            and self._cryptos[quic_tls.Epoch.ONE_RTT].send.is_valid()
        )

    def _start_pmtu(self, addr, now: float) -> None:
        """A new search for the path to ``addr`` (the first, or after the peer moved), from base."""
        max_size, ladder = self._pmtu_limit
        if self._peer_max_udp_payload is not None:  # RFC 9000 section 18.2: never above it
            max_size = min(max_size, self._peer_max_udp_payload)
        base = self._configuration.max_datagram_size
        self.pmtu = PathMtu(max_size=max(base, max_size), base=base, ladder=ladder)
        self._pmtu_addr = addr
        self._loss.pmtu = self.pmtu
        self._pmtu_done = False
        self.pmtu.start(now)
        self._pmtu_update("new path")

    def _build_probe(self, probe: Probe, now: float) -> bytes:
        """A 1-RTT datagram of exactly ``probe.size`` bytes: PING, then PADDING."""
        builder = QuicPacketBuilder(
            host_cid=self.host_cid,
            is_client=self._is_client,
            max_datagram_size=probe.size,
            packet_number=self._packet_number,
            peer_cid=self._peer_cid.cid,
            peer_token=self._peer_token,
            quic_logger=self._quic_logger,
            spin_bit=self._spin_bit,
            version=self._version,
        )
        builder.start_packet(QuicPacketType.ONE_RTT, self._cryptos[quic_tls.Epoch.ONE_RTT])
        builder.start_frame(QuicFrameType.PING, handler=self._on_probe_delivery, handler_args=(self.pmtu, probe))
        padding = builder.remaining_buffer_space
        buf = builder.start_frame(QuicFrameType.PADDING, capacity=padding)  # writes the first 0x00
        buf.push_bytes(bytes(padding - 1))
        (datagram,), (packet,) = builder.flush()
        self._packet_number = builder.packet_number
        packet.sent_time = now
        packet.in_flight = False  # no bytes in flight, no congestion signal when lost
        packet.is_ack_eliciting = False  # no PTO for it, no data retransmitted for it
        self._loss.on_packet_sent(packet=packet, space=self._spaces[quic_tls.Epoch.ONE_RTT])
        self._network_paths[0].bytes_sent += len(datagram)
        return datagram

    def _on_probe_delivery(self, delivery: QuicDeliveryState, pmtu: PathMtu, probe: Probe) -> None:
        if pmtu is not self.pmtu:
            return  # a probe of a search that has since started over
        if delivery == QuicDeliveryState.ACKED:
            pmtu.probe_acked(probe)
        else:
            pmtu.probe_lost(probe)
        self._pmtu_update("probe")

    def _pmtu_update(self, reason: str) -> None:
        """Make the datagram size (and what aioquic derives from it) what the search says,
        with an event for a new size and one when the search settles."""
        pmtu = self.pmtu
        size, previous = pmtu.size, self._max_datagram_size
        if size != previous:
            self._set_datagram_size(size)
            self._events.append(DatagramSizeChanged(size, previous, reason))
        done = pmtu.state is State.SEARCH_COMPLETE
        if done and not self._pmtu_done:
            self._events.append(PathMtuSearchDone(size, pmtu.probes_sent, pmtu.probes_lost))
        self._pmtu_done = done

    def _set_datagram_size(self, size: int) -> None:
        self._max_datagram_size = size
        recovery = self._loss
        recovery._pacer._max_datagram_size = size
        cc = recovery._cc
        if hasattr(cc, "_max_datagram_size"):  # reno and cubic: window floor and growth step
            cc._max_datagram_size = size
        if hasattr(cc, "additive_increase_factor"):  # cubic
            cc.additive_increase_factor = size

    # aioquic holds every ACK back for its delay, so a reply that leaves sooner goes
    # without it and a timer sends the ACK alone later: two packets each way per
    # call.  Sending every ACK at once (no delay) costs the same, since the ACK
    # leaves before the reply is written.  So, as RFC 9000 section 13.2 lets a
    # receiver do: an ACK goes at once after two full-size packets' worth of
    # bytes (a bulk sender hears as often as TCP's does) or a PING (a path-MTU or
    # loss probe asks for one); with the next stream data sent if no ACK left
    # within ACK_RIDE_GAP (a lone call's reply carries its request's ACK); else
    # alone ACK_DELAY after it could have ridden (so 1-3 ms after the packet).
    # Calls in a row go one packet each way, an ACK riding on one every 2 ms:
    # each ACK costs both ends about 6 µs of aioquic's Python, and the ACK of
    # every second packet (RFC 9000's suggestion, meant for bulk senders'
    # congestion control) cost sequential calls 10-20 µs each.

    @property
    def handshake_confirmed(self) -> bool:
        """Both ends hold 1-RTT keys and know it (RFC 9001 section 4.1.2)."""
        return self._handshake_confirmed

    def ack_at_once(self) -> None:
        """Send every ACK alone as soon as what it acknowledges is processed (the
        policy before ACKs rode on data: more datagrams, an earlier wake-up)."""
        self._ack_delay = 0.0
        self._ack_with_data = False

    def _handle_padding_frame(self, context, frame_type: int, buf: Buffer) -> None:
        """Skip a run of PADDING up to the next other byte, as aioquic does, in C.

        aioquic tests the bytes one by one in Python: 0.6-0.7 ms for a
        client's Initial, which fills a whole 16,000-byte datagram on loopback
        (and for the server's flight and every path-MTU probe), in the one
        thread that serves every peer.
        """
        pos = buf.tell()
        rest = buf.data_slice(pos, buf.capacity)
        if rest == bytes(len(rest)):  # the usual case, padding to the packet's end: a memcmp
            buf.seek(buf.capacity)
        else:
            buf.seek(pos + len(rest) - len(rest.lstrip(b"\x00")))
        if self._quic_logger is not None:
            context.quic_logger_frames.append(self._quic_logger.encode_padding_frame())

    def _stream_blocked(self) -> bool:
        """Whether a stream of ours waits for the peer to allow more: the peer frees
        its streams, and so allows more, once our ACKs say its replies arrived."""
        return bool(self._streams_blocked_bidi or self._streams_blocked_uni)

    def _handle_ping_frame(self, context, frame_type: int, buf: Buffer) -> None:
        super()._handle_ping_frame(context, frame_type, buf)
        if self._ack_with_data:  # a probe waits for its ACK: it goes at once
            self._spaces[context.epoch].ack_at = context.time

    def receive_datagram(self, data: bytes, addr, now: float) -> None:
        waiting = self._unacked > 0
        super().receive_datagram(data, addr, now)
        self._clock = now
        space = self._spaces.get(quic_tls.Epoch.ONE_RTT)
        if self._ack_with_data and space is not None and space.ack_at is not None:
            self._unacked += len(data)
            if self._unacked >= 2 * self._max_datagram_size or self._stream_blocked():
                space.ack_at = now
            elif not waiting and space.ack_at > now:  # the first to acknowledge since our last ACK:
                # it waits ACK_DELAY from when it may ride, so a run of calls carries it, not a timer
                space.ack_at = max(space.ack_at, self._ack_sent_at + ACK_RIDE_GAP + self._ack_delay)

    def send_stream_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        super().send_stream_data(stream_id, data, end_stream)
        space = self._spaces.get(quic_tls.Epoch.ONE_RTT)
        if (self._ack_with_data and space is not None and space.ack_at is not None
                and (self._clock - self._ack_sent_at >= ACK_RIDE_GAP or self._stream_blocked())):
            space.ack_at = 0.0  # due now: it goes in the packet carrying this data

    def datagrams_to_send(self, now: float) -> list:
        pending = self._unacked > 0
        datagrams = super().datagrams_to_send(now)
        self._clock = now
        space = self._spaces.get(quic_tls.Epoch.ONE_RTT)
        if space is None or space.ack_at is None:
            self._unacked = 0
            if pending:
                self._ack_sent_at = now
        return datagrams

    def get_timer(self) -> float | None:
        timer = super().get_timer()
        if self.pmtu is not None and self._state not in END_STATES:
            deadline = self.pmtu.deadline
            if deadline is not None and (timer is None or deadline < timer):
                return deadline
        return timer

    def handle_timer(self, now: float) -> None:
        super().handle_timer(now)
        if self.pmtu is not None and self._state not in END_STATES:
            self.pmtu.on_timer(now)
            self._pmtu_update("probe")

    def _parse_transport_parameters(self, data: bytes, from_session_ticket: bool = False) -> None:
        super()._parse_transport_parameters(data, from_session_ticket)
        # aioquic ignores the peer's max_udp_payload_size; the path-MTU search must not exceed it
        self._peer_max_udp_payload = pull_quic_transport_parameters(Buffer(data=data)).max_udp_payload_size

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        if self._is_client:
            # aioquic offers key shares for P-256, P-384, X25519 and X448, generating
            # a key for each, and the server takes the first it supports: P-256.
            # A meshd peer takes X25519, so that is the one offered.
            self.tls._supported_groups = [quic_tls.Group.X25519]
        else:
            self.tls._request_client_certificate = True

    def _write_connection_limits(self, builder, space) -> None:  # type: ignore[override]
        limit = self._local_max_data
        used, limit.used = limit.used, 0
        try:
            super()._write_connection_limits(builder, space)
        finally:
            limit.used = used

    def _write_stream_limits(self, builder, space, stream) -> None:  # type: ignore[override]
        if stream.max_stream_data_local_sent == stream.max_stream_data_local:
            return  # nothing to announce (called for every stream in every packet: keep it cheap)
        receiver = stream.receiver
        highest, receiver.highest_offset = receiver.highest_offset, 0
        try:
            super()._write_stream_limits(builder, space, stream)
        finally:
            receiver.highest_offset = highest
