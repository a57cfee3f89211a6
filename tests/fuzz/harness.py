"""What the fuzz targets and the seeding script share: a fixed identity and
clock, and the ways bytes reach a decoder on the network."""

from __future__ import annotations

import hashlib
from typing import Coroutine, Iterator

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshd.wire import DEFAULT_MAX_FRAME, FrameDecoder, encode_frame

# The peer whose data the targets decode: seeds are signed with this key, so a
# target that checks a signature (or an author) sees valid seeds get through.
PRIVATE = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
PUBLIC = PRIVATE.public_key().public_bytes_raw()
sign = PRIVATE.sign

# The wall-clock time targets decide freshness at; seeds are made fresh at it.
NOW = 1_750_000_000

DOC_NAME = "fuzz"  # the CRDT document the batch target holds (owned by PUBLIC)


def frames(data: bytes, max_size: int = DEFAULT_MAX_FRAME) -> Iterator[object]:
    """Each whole frame of ``data`` (meshd.wire frames: 4-byte length, msgpack),
    decoded with the network's limits; a trailing partial frame is left, as a
    stream that has not delivered it yet.  Raises FrameError for a bad frame."""
    decoder = FrameDecoder(max_size)
    decoder.feed(data)
    while True:
        whole, value = decoder.next_frame()
        if not whole:
            return
        yield value


def framed(*values: object) -> bytes:
    """The stream of frames holding ``values`` (what :func:`frames` reads back)."""
    return b"".join(encode_frame(value) for value in values)


def drive(coro: Coroutine):
    """The result of ``coro``, run without an event loop.

    The handlers the targets call are async but wait for nothing given
    in-memory state; RuntimeError if ``coro`` does wait (a target that would
    hang on the network is a bug of the target, not a finding).
    """
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("the coroutine waited for something; fuzz targets run without I/O")


def sync_keys(numbers) -> list[bytes]:
    """Reconciliation keys (8-byte lamport, 32-byte hash) for ``numbers``, as
    documents have them; the reconcile target and its seeds share them."""
    return [n.to_bytes(8, "big") + hashlib.sha256(n.to_bytes(4, "big")).digest() for n in numbers]


LANE_KEY = bytes(range(32, 64))  # the client->server key of the lane the lane target serves


class MemoryStream:
    """The few members of a trio.SocketStream a lane ``_Framer`` uses, in memory:
    it receives ``incoming`` (then the end of the stream) and keeps what is sent."""

    def __init__(self, incoming: bytes = b""):
        self.socket = self
        self.sent = bytearray()
        self._incoming = memoryview(incoming)

    async def recv_into(self, view: memoryview, nbytes: int) -> int:
        taken = self._incoming[:nbytes]
        view[:len(taken)] = taken
        self._incoming = self._incoming[len(taken):]
        return len(taken)

    async def send_all(self, data) -> None:
        self.sent += data
