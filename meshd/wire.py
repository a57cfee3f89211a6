"""Length-prefixed msgpack frames with a size limit.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack.
Decoding never trusts the peer: the declared length is checked against the
limit before anything is buffered, msgpack runs with limits on every container,
extension types are refused, and map keys must be strings or bytes.
"""

from __future__ import annotations

import struct

import msgpack

DEFAULT_MAX_FRAME = 16 * 1024 * 1024
_HEADER = struct.Struct(">I")


class FrameError(Exception):
    """Bytes from a peer that are not a valid frame."""


class FrameTooLarge(FrameError):
    """A frame longer than the limit, sent or received."""


def _refuse_ext(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack extension type {code} is not accepted")


def pack(obj: object) -> bytes:
    """msgpack bytes of ``obj`` (bytes stay bytes, str stays str)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, max_size: int = DEFAULT_MAX_FRAME) -> object:
    """Decode one msgpack value from untrusted bytes, or raise FrameError."""
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            max_bin_len=max_size,
            max_str_len=max_size,
            max_array_len=max_size // 2,
            max_map_len=max_size // 4,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise FrameError(f"malformed msgpack: {exc}") from None


def frame_parts(obj: object, max_size: int = DEFAULT_MAX_FRAME) -> tuple[bytes, bytes]:
    """The 4-byte header and the body of a frame holding ``obj``.

    Raises FrameTooLarge if the body would exceed ``max_size``.  Kept apart so
    a large body can be sent without copying it behind its header.
    """
    body = pack(obj)
    if len(body) > max_size:
        raise FrameTooLarge(f"frame of {len(body)} bytes exceeds the {max_size}-byte limit")
    return _HEADER.pack(len(body)), body


def encode_frame(obj: object, max_size: int = DEFAULT_MAX_FRAME) -> bytes:
    """One frame holding ``obj``; FrameTooLarge if it would exceed ``max_size``."""
    header, body = frame_parts(obj, max_size)
    return header + body


class FrameDecoder:
    """Incremental decoder: feed bytes in, take whole decoded frames out.

    Consumed bytes are dropped lazily (a read offset), so decoding a run of
    frames does not move the rest of the buffer after each one.
    """

    def __init__(self, max_size: int = DEFAULT_MAX_FRAME):
        self.max_size = max_size
        self._buf = bytearray()
        self._pos = 0

    def feed(self, data: bytes) -> None:
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a frame."""
        return len(self._buf) - self._pos

    @property
    def declared(self) -> int | None:
        """The body length the next frame's header declares, once its header is here; else None."""
        if len(self._buf) - self._pos < 4:
            return None
        return _HEADER.unpack_from(self._buf, self._pos)[0]

    def next_frame(self) -> tuple[bool, object]:
        """``(True, value)`` for the next whole frame, ``(False, None)`` if incomplete.

        Raises FrameTooLarge as soon as a header declares more than the limit,
        and FrameError for a body that is not valid msgpack.
        """
        buf, pos = self._buf, self._pos
        if len(buf) - pos < 4:
            return False, None
        (length,) = _HEADER.unpack_from(buf, pos)
        if length > self.max_size:
            raise FrameTooLarge(
                f"peer announced a {length}-byte frame; the limit is {self.max_size}"
            )
        end = pos + 4 + length
        if len(buf) < end:
            return False, None
        with memoryview(buf) as view, view[pos + 4 : end] as body:
            value = unpack(body, self.max_size)
        if end == len(buf):
            buf.clear()
            self._pos = 0
        else:
            self._pos = end
        return True, value
