"""Frames over a CallStream: read and write whole msgpack values."""

from __future__ import annotations

from ..streams import CallStream, StreamAborted, StreamRefused
from ..wire import FrameDecoder, FrameError, FrameTooLarge, frame_parts
from . import protocol as P
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
    """Reads and writes length-prefixed msgpack frames on one stream."""

    __slots__ = ("stream", "max_frame", "_decoder")

    def __init__(self, stream: CallStream, max_frame: int):
        self.stream = stream
        self.max_frame = max_frame
        self._decoder = FrameDecoder(max_frame)

    async def read(self) -> tuple[bool, object]:
        """``(True, value)`` for the next frame, ``(False, None)`` at a clean end.

        An end in the middle of a frame raises FrameError; a reset raises
        StreamAborted; a malformed or oversized frame raises FrameError.
        """
        decoder = self._decoder
        while True:
            ok, value = decoder.next_frame()
            if ok:
                return True, value
            data = await self.stream.receive_some()
            if not data:
                if decoder.buffered:
                    raise FrameError("stream ended in the middle of a frame")
                return False, None
            decoder.feed(data)

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

        Raises FrameTooLarge, having sent nothing, if it exceeds the limit.
        """
        header, body = frame_parts(value, self.max_frame)
        if len(body) < _SEPARATE_BODY:
            await self.stream.send_all(header + body, eof)
        else:  # a large body is not worth copying once more behind its header
            await self.stream.send_all(header)
            await self.stream.send_all(body, eof)
