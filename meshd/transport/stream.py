"""One bidirectional QUIC stream as a CallStream, with backpressure both ways.

Sending waits while more than the connection's ``send_high_water`` bytes
(``transport.send_high_water``, default ``SEND_HIGH_WATER``) of this stream, or
``connection_send_high_water`` bytes of all the connection's streams
(``transport.connection_send_high_water``, default ``CONNECTION_SEND_HIGH_WATER``),
are queued or unacknowledged, so a slow reader slows the writer instead of growing
a buffer, and a peer that reads none of its answers holds a bounded amount here.
Receiving grants the peer flow-control credit only for bytes the application
has read (see ``PeerConnection.consumed``), so a reader that stops reading
stops the writer.
"""

from __future__ import annotations

from typing import Protocol

import trio

from ..streams import StreamAborted, StreamRefused

SEND_HIGH_WATER = 4 << 20  # the default; with ACKs every 16 datagrams, 1 MiB left the sender idle
CONNECTION_SEND_HIGH_WATER = 8 << 20  # the default: two streams at their high water


class StreamOwner(Protocol):
    """What a stream needs of the connection that carries it (``PeerConnection``).

    The owner feeds the stream from the other side by calling its
    ``data_received``, ``peer_aborted``, ``peer_stopped_sending`` and
    ``writable_again``.
    """

    def send_room(self, stream_id: int) -> int:
        """Bytes the stream may queue now (none if 0 or less): what neither its
        own nor the connection's high water forbids."""

    def send_data(self, stream_id: int, data: bytes, end: bool) -> None:
        """Queue ``data`` (and the end of the stream if ``end``) for sending;
        StreamAborted if the stream can no longer send."""

    def sender_reset(self, stream_id: int) -> bool:
        """The stream's sending side was reset (by us, or on the peer's STOP_SENDING)."""

    def wait_for_acks(self, stream: QuicCallStream) -> None:
        """Call ``stream.writable_again()`` once it has ``send_room`` again (the
        owner may wait for more room than that, to wake fewer writers)."""

    def consumed(self, stream: QuicCallStream, nbytes: int) -> None:
        """The application took ``nbytes``: give the peer that much more credit."""

    def done_reading(self, stream: QuicCallStream, *, stop_peer: bool) -> None:
        """The application closed ``stream``; ask the peer to stop sending if
        ``stop_peer``, and forget the stream once both directions are over."""

    def reset_stream(self, stream: QuicCallStream) -> None:
        """Abort both directions of ``stream`` and forget it."""


class QuicCallStream:
    """A QUIC stream driven by the connection that carries it."""

    __slots__ = (
        "_conn", "stream_id", "_recv", "_eof", "_aborted", "_send_stopped",
        "_sent_eof", "_closed", "_waiters", "_watch", "_refused",
    )

    def __init__(self, conn: StreamOwner, stream_id: int):
        self._conn = conn
        self.stream_id = stream_id
        self._recv: list[bytes] = []
        self._eof = False
        self._aborted: str | None = None
        self._refused = False
        self._send_stopped = False
        self._sent_eof = False
        self._closed = False
        self._waiters = trio.lowlevel.ParkingLot()  # the reader and the writer wait here
        self._watch: trio.CancelScope | None = None

    # --- the CallStream interface -------------------------------------------

    async def receive_some(self) -> bytes:
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._recv and not self._eof and self._aborted is None:
            await self._waiters.park()
        if self._aborted is not None:
            raise self._abort_error()
        if not self._recv:
            return b""
        chunks = self._recv
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._conn.consumed(self, len(data))
        return data

    async def send_all(self, data: bytes, eof: bool = False) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        conn = self._conn
        view = memoryview(data)
        while True:
            self._check_sendable()
            room = conn.send_room(self.stream_id)
            if room > 0:
                chunk = view[:room]  # aioquic copies it into its send buffer
                view = view[len(chunk):]
                last = not view
                conn.send_data(self.stream_id, chunk, eof and last)
                if last:
                    self._sent_eof = eof
                    return
            conn.wait_for_acks(self)
            await self._waiters.park()

    async def close(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed or self._aborted is not None:
            return
        self._closed = True
        unread = bool(self._recv)
        self._recv.clear()
        if not self._sent_eof and not self._stopped():
            self._sent_eof = True
            self._conn.send_data(self.stream_id, b"", True)
        self._conn.done_reading(self, stop_peer=unread)

    def abort(self) -> None:
        if self._aborted is None:
            self._aborted = "stream aborted locally"
            self._closed = True
            self._conn.reset_stream(self)
        self._wake()

    def cancel_on_abort(self, scope: trio.CancelScope | None) -> None:
        self._watch = scope
        if scope is not None and (self._aborted is not None or self._send_stopped):
            scope.cancel()

    # --- driven by the owning connection ------------------------------------

    def _abort_error(self) -> StreamAborted:
        return (StreamRefused if self._refused else StreamAborted)(self._aborted)

    def _check_sendable(self) -> None:
        if self._aborted is not None:
            raise self._abort_error()
        if self._stopped():
            raise StreamAborted("peer asked us to stop sending")
        if self._sent_eof:
            raise StreamAborted("stream already ended its sending side")

    def _stopped(self) -> bool:
        if not self._send_stopped and self._conn.sender_reset(self.stream_id):
            self._send_stopped = True
        return self._send_stopped

    def data_received(self, data: bytes, end: bool) -> int:
        """Buffer data from the peer; returns how many bytes were discarded."""
        discarded = 0
        if self._closed:
            discarded = len(data)  # nobody will read it: credit it back at once
        elif data:
            self._recv.append(data)
        if end:
            self._eof = True
        self._waiters.unpark_all()
        return discarded

    def peer_aborted(self, reason: str, *, refused: bool = False) -> None:
        """The peer reset the stream, or the connection died (``refused``: before
        the peer saw the stream, see :class:`meshd.streams.StreamRefused`)."""
        if self._aborted is None:
            self._aborted = reason
            self._refused = refused
        if self._watch is not None:
            self._watch.cancel()
        self._wake()

    def peer_stopped_sending(self) -> None:
        self._send_stopped = True
        if self._watch is not None and not self._closed:
            self._watch.cancel()
        self._wake()

    def writable_again(self) -> None:
        self._wake()

    def _wake(self) -> None:
        self._waiters.unpark_all()

    @property
    def finished(self) -> bool:
        """Both directions are over, from the application's point of view."""
        return self._aborted is not None or (self._closed and self._eof)
