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


def encode_frame(obj: object, max_size: int = DEFAULT_MAX_FRAME) -> bytes:
    """One frame holding ``obj``; FrameTooLarge if it would exceed ``max_size``."""
    body = pack(obj)
    if len(body) > max_size:
        raise FrameTooLarge(f"frame of {len(body)} bytes exceeds the {max_size}-byte limit")
    return _HEADER.pack(len(body)) + body


class FrameDecoder:
    """Incremental decoder: feed bytes in, take whole decoded frames out."""

    def __init__(self, max_size: int = DEFAULT_MAX_FRAME):
        self.max_size = max_size
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a frame."""
        return len(self._buf)

    def next_frame(self) -> tuple[bool, object]:
        """``(True, value)`` for the next whole frame, ``(False, None)`` if incomplete.

        Raises FrameTooLarge as soon as a header declares more than the limit,
        and FrameError for a body that is not valid msgpack.
        """
        buf = self._buf
        if len(buf) < 4:
            return False, None
        (length,) = _HEADER.unpack_from(buf)
        if length > self.max_size:
            raise FrameTooLarge(
                f"peer announced a {length}-byte frame; the limit is {self.max_size}"
            )
        end = 4 + length
        if len(buf) < end:
            return False, None
        body = bytes(buf[4:end])
        del buf[:end]
        return True, unpack(body, self.max_size)
