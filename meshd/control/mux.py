"""Many call streams over one control-socket connection, without I/O.

A client opens streams on one Unix-socket connection and runs one RPC call on
each, as a QUIC connection carries one call per stream.  Every frame is a
9-byte header, then its payload::

    stream id  u32, big-endian; the client numbers its streams 1, 2, 3, ...
    type       u8
    length     u32, the payload's

    DATA    0  1 to MAX_CHUNK bytes of the stream, within the receiver's window
    END     1  no payload: the sender has finished sending on this stream (a FIN)
    RESET   2  no payload: the sender abandons the stream both ways (cancellation)
    CREDIT  3  u32 payload: the receiver consumed that many bytes; send as many more

Each direction of a stream may have ``window`` bytes unconsumed at the
receiver, so a reader that stops reading stops only its own stream, and a
connection buffers at most ``max_streams * window`` bytes.  A stream opened
beyond ``max_streams`` is reset (it costs its opener that stream); any other
frame that breaks these rules is a :class:`MuxError`, and the connection must
be closed (it costs the sender its connection).  A frame for a stream that is
gone (reset, or both sides done) is dropped.

:class:`Mux` keeps the streams' state; the trio shell (:mod:`.session`) moves
the bytes.  Nothing here imports trio.
"""

from __future__ import annotations

import struct

HEADER = struct.Struct(">IBI")
_CREDIT = struct.Struct(">I")
DATA, END, RESET, CREDIT = range(4)

MAX_CHUNK = 64 << 10  # payload of one DATA frame
WINDOW = 256 << 10  # unconsumed bytes per stream and direction
MAX_STREAMS = 64  # open streams per connection
_MAX_ID = (1 << 32) - 1


class MuxError(Exception):
    """The peer broke the framing rules; the connection must be closed."""


class StreamState:
    """One stream as :class:`Mux` tracks it (the shell reads these fields)."""

    __slots__ = ("id", "send_window", "inbox", "ended_in", "ended_out", "reset", "reading",
                 "_recv_window", "_consumed")

    def __init__(self, stream_id: int, window: int):
        self.id = stream_id
        self.send_window = window  # bytes we may still send
        self.inbox = bytearray()  # received, not yet read
        self.ended_in = False  # the peer sent END
        self.ended_out = False  # we sent END
        self.reset = False  # either side reset it, or the connection is gone
        self.reading = True  # False once we closed it: what arrives is dropped
        self._recv_window = window  # bytes the peer may still send
        self._consumed = 0  # read but not yet credited

    @property
    def readable(self) -> bool:
        """Whether a read returns at once (data, the end, or the reset)."""
        return bool(self.inbox) or self.ended_in or self.reset

    @property
    def done(self) -> bool:
        return self.reset or (self.ended_in and self.ended_out)


class Mux:
    """The streams of one connection: ``client`` opens them, the server accepts them."""

    def __init__(self, *, client: bool, max_streams: int = MAX_STREAMS, window: int = WINDOW,
                 max_chunk: int = MAX_CHUNK):
        self.client = client
        self.max_streams = max_streams
        self.window = window
        self.max_chunk = max_chunk
        self.streams: dict[int, StreamState] = {}
        self._last_id = 0  # the highest stream id opened so far
        self._out = bytearray()
        self._in = bytearray()

    # --- streams ------------------------------------------------------------------------

    def can_open(self) -> bool:
        """Whether :meth:`open` would succeed now (fewer than ``max_streams`` open)."""
        return len(self.streams) < self.max_streams

    def open(self) -> StreamState:
        """A new stream (client side).  MuxError at ``max_streams`` or when ids run out."""
        if not self.client:
            raise MuxError("only the client opens streams")
        if not self.can_open() or self._last_id == _MAX_ID:
            raise MuxError("no stream can be opened now")
        self._last_id += 1
        state = self.streams[self._last_id] = StreamState(self._last_id, self.window)
        return state

    def send(self, state: StreamState, data: bytes | memoryview, end: bool = False) -> int:
        """Queue as much of ``data`` as the peer's window allows; returns how many bytes.

        With ``end``, END follows once all of ``data`` is queued.  Nothing is
        queued on a stream that was reset or already ended.
        """
        if state.reset or state.ended_out:
            return 0
        taken = min(len(data), state.send_window)
        for start in range(0, taken, self.max_chunk):
            chunk = data[start:min(taken, start + self.max_chunk)]
            self._out += HEADER.pack(state.id, DATA, len(chunk))
            self._out += chunk
        state.send_window -= taken
        if end and taken == len(data):
            self._frame(state.id, END)
            state.ended_out = True
            self._forget_if_done(state)
        return taken

    def read(self, state: StreamState, limit: int) -> bytes:
        """Up to ``limit`` received bytes (crediting them to the peer); ``b""`` after
        its END.  Call only when ``state.readable`` and not ``state.reset``."""
        data = bytes(state.inbox[:limit])
        del state.inbox[:limit]
        self._credit(state, len(data))
        return data

    def close(self, state: StreamState) -> None:
        """End our side (END if not sent yet) and stop reading: later data is dropped."""
        if state.reset:
            return
        if not state.ended_out:
            self._frame(state.id, END)
            state.ended_out = True
        state.reading = False
        self._credit(state, len(state.inbox), at_once=True)
        state.inbox.clear()
        self._forget_if_done(state)

    def reset(self, state: StreamState) -> None:
        """Abandon the stream both ways (RESET to the peer, unless it is gone already)."""
        if not state.reset:
            self._frame(state.id, RESET)
            self._drop(state)

    def connection_lost(self) -> None:
        """The connection is gone: every stream is reset."""
        for state in list(self.streams.values()):
            self._drop(state)

    # --- bytes ----------------------------------------------------------------------------

    @property
    def wants_to_send(self) -> bool:
        """Whether frames are queued for the socket."""
        return bool(self._out)

    def data_to_send(self) -> bytes:
        """The frames queued since the last call, to write to the socket in order."""
        out, self._out = bytes(self._out), bytearray()
        return out

    def requeue(self, unsent: bytes) -> None:
        """Put back the tail of :meth:`data_to_send`'s bytes the socket did not take."""
        self._out[:0] = unsent

    def receive_data(self, data: bytes) -> list[StreamState]:
        """Take bytes from the socket; returns the streams the peer opened (server side).

        Raises MuxError for a frame that breaks the rules; the connection is
        then unusable.  Frames for streams that are gone are dropped.
        """
        self._in += data
        opened: list[StreamState] = []
        pos = 0
        while len(self._in) - pos >= HEADER.size:
            stream_id, kind, length = HEADER.unpack_from(self._in, pos)
            self._check(kind, length)
            end = pos + HEADER.size + length
            if len(self._in) < end:
                break
            payload = bytes(self._in[pos + HEADER.size:end])
            pos = end
            state = self.streams.get(stream_id)
            if state is None and stream_id > self._last_id:
                state = self._accept(stream_id, kind)
                if state is None:
                    continue
                opened.append(state)
            if state is not None:
                self._handle(state, kind, payload)
        del self._in[:pos]
        return opened

    # --- internals ---------------------------------------------------------------------------

    def _check(self, kind: int, length: int) -> None:
        if kind == DATA:
            if not 0 < length <= self.max_chunk:
                raise MuxError(f"a DATA frame carries 1 to {self.max_chunk} bytes, not {length}")
        elif kind == CREDIT:
            if length != _CREDIT.size:
                raise MuxError("a CREDIT frame carries 4 bytes")
        elif kind in (END, RESET):
            if length:
                raise MuxError("END and RESET frames carry nothing")
        else:
            raise MuxError(f"unknown frame type {kind}")

    def _accept(self, stream_id: int, kind: int) -> StreamState | None:
        """A stream the peer opens with this frame, or None if it is refused."""
        if self.client:
            raise MuxError("the server opened a stream")
        if kind == CREDIT:
            raise MuxError(f"CREDIT for stream {stream_id}, which was never opened")
        self._last_id = stream_id
        if kind == RESET:  # opened and abandoned before its first byte
            return None
        if not self.can_open():
            self._frame(stream_id, RESET)  # over the limit: the sender loses this stream only
            return None
        state = self.streams[stream_id] = StreamState(stream_id, self.window)
        return state

    def _handle(self, state: StreamState, kind: int, payload: bytes) -> None:
        if kind == RESET:
            self._drop(state)
            return
        if kind == CREDIT:
            state.send_window += _CREDIT.unpack(payload)[0]
            if state.send_window > 1 << 31:
                raise MuxError("CREDIT beyond any window")
            return
        if state.ended_in:
            raise MuxError(f"stream {state.id} carries data after its END")
        if kind == END:
            state.ended_in = True
            self._forget_if_done(state)
            return
        if len(payload) > state._recv_window:
            raise MuxError(f"stream {state.id} sent beyond its window")
        state._recv_window -= len(payload)
        if state.reading:
            state.inbox += payload
        else:
            self._credit(state, len(payload), at_once=True)

    def _credit(self, state: StreamState, consumed: int, *, at_once: bool = False) -> None:
        """Give the peer back ``consumed`` bytes of window, in batches of half a window."""
        state._consumed += consumed
        if state._consumed and not state.ended_in and (at_once or state._consumed >= self.window // 2):
            self._out += HEADER.pack(state.id, CREDIT, _CREDIT.size) + _CREDIT.pack(state._consumed)
            state._recv_window += state._consumed
            state._consumed = 0

    def _frame(self, stream_id: int, kind: int) -> None:
        self._out += HEADER.pack(stream_id, kind, 0)

    def _drop(self, state: StreamState) -> None:
        state.reset = True
        state.inbox.clear()
        self.streams.pop(state.id, None)

    def _forget_if_done(self, state: StreamState) -> None:
        if state.done:
            self.streams.pop(state.id, None)
