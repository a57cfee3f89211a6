"""Frames over a CallStream: read and write whole msgpack values."""

from __future__ import annotations

from ..streams import CallStream, StreamAborted, StreamRefused
from ..wire import FrameDecoder, FrameError, FrameTooLarge, frame_parts
from . import protocol as P
from .budget import CallBytes
from .errors import FrameTooLargeError, ProtocolViolation, Unavailable, error_from_wire


_SEPARATE_BODY = 64 << 10


def connection_lost(exc: StreamAborted) -> Unavailable:
    """Unavailable for a lost stream, marked ``unprocessed`` if the peer never saw it."""
    error = Unavailable(f"connection lost during the call: {exc}")
    error.unprocessed = isinstance(exc, StreamRefused)
    return error


def call_error(exc: StreamAborted | FrameError) -> Exception:
    """The RpcError a caller sees for a transport or framing failure."""
    if isinstance(exc, StreamAborted):
        return connection_lost(exc)
    if isinstance(exc, FrameTooLarge):
        return FrameTooLargeError(str(exc))
    return ProtocolViolation(f"bad reply from peer: {exc}")


class Framed:
    """Reads and writes length-prefixed msgpack frames on one stream.

    Given ``held`` (a served call's :class:`~meshd.rpc.budget.CallBytes`), each
    frame read is counted as held from the moment its header arrives, before
    its body is read (see :meth:`read`), and each frame written while it is
    being queued; a frame over the budget raises OverBudget instead.
    """

    __slots__ = ("stream", "max_frame", "_decoder", "_held", "last_held")

    def __init__(self, stream: CallStream, max_frame: int, held: CallBytes | None = None):
        self.stream = stream
        self.max_frame = max_frame
        self._decoder = FrameDecoder(max_frame)
        self._held = held
        self.last_held = 0  # bytes of the last frame read that count as held (to give back early)

    async def read(self) -> tuple[bool, object]:
        """``(True, value)`` for the next frame, ``(False, None)`` at a clean end.

        An end in the middle of a frame raises FrameError; a reset raises
        StreamAborted; a malformed or oversized frame raises FrameError; with
        ``held``, a frame over the budget raises OverBudget once its header is
        here (its body unread), and the frame returned stays held until the
        call ends or :meth:`let_go`.
        """
        decoder, held = self._decoder, self._held
        counted = held is None
        while True:
            if not counted and (size := decoder.declared) is not None:
                if size <= self.max_frame:  # a larger one is FrameTooLarge, whatever the budget
                    self.last_held = held.take(size)
                counted = True
            ok, value = decoder.next_frame()
            if ok:
                return True, value
            data = await self.stream.receive_some()
            if not data:
                if decoder.buffered:
                    raise FrameError("stream ended in the middle of a frame")
                return False, None
            decoder.feed(data)

    def let_go(self) -> None:
        """Stop counting the last frame read as held (it has been handed on)."""
        if self.last_held:
            self._held.give(self.last_held)
            self.last_held = 0

    async def read_answer(self, ended: str, *, errors: bool = True) -> tuple[int, object]:
        """The peer's next frame as ``(type, payload)``, failures as RpcErrors.

        A lost stream raises Unavailable, a bad frame ProtocolViolation or
        FrameTooLargeError, an end of stream Unavailable(``ended``), and with
        ``errors`` an ERROR frame the error it carries.
        """
        try:
            ok, frame = await self.read()
        except StreamAborted as exc:
            raise connection_lost(exc) from None
        except FrameTooLarge as exc:
            raise FrameTooLargeError(str(exc)) from None
        except FrameError as exc:
            raise ProtocolViolation(f"bad frame from peer: {exc}") from None
        if not ok:
            raise Unavailable(ended)
        kind, value = P.parse_frame(frame)
        if kind == P.ERROR and errors:
            raise error_from_wire(*value)
        return kind, value

    async def write(self, value: object, *, eof: bool = False) -> None:
        """Send one frame (and with ``eof``, end our side after it).

        Raises FrameTooLarge, having sent nothing, if it exceeds the limit,
        and with ``held`` OverBudget, having sent nothing, if it passes the budget.
        """
        header, body = frame_parts(value, self.max_frame)
        counted = self._held.take(len(body)) if self._held is not None else 0
        try:
            if len(body) < _SEPARATE_BODY:
                await self.stream.send_all(header + body, eof)
            else:  # a large body is not worth copying once more behind its header
                await self.stream.send_all(header)
                await self.stream.send_all(body, eof)
        finally:
            if counted:
                self._held.give(counted)
