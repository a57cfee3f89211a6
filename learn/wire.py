"""Named tensors on the wire, and the signed contribution that heads them.

A tensor set is a stream of msgpack-able frames: per tensor a header
``{"t": name, "codec", "dtype", "shape", "block", "bytes": payload length}``
then its payload in chunk frames ``{"c": bytes}`` of at most :data:`CHUNK`
bytes, so neither side holds more than one tensor plus one chunk beyond the
tensors themselves.  :class:`Decoder` checks every frame against
:class:`Limits` and the codec's exact payload size; anything else is a
:class:`WireError`.  A sender may instead send the headers alone and lend
the payloads as numbered chunks fetched some other way (:func:`lent_chunks`,
:func:`chunk_counts`, :func:`chunk_ids`); they go through the same Decoder.

A :class:`Contribution` says who sent which tensors for which round: its
``digest`` is blake3 over the tensors (names, codecs, dtypes, shapes,
blocks, payloads, in name order) and its author signs it, so a copy passed
on by another member cannot be altered or forged.  Signing and checking are
injected (meshd passes its Ed25519 identity).  No torch here.

An all-reduce's messages name the round's roster by :func:`roster_digest`
(32 bytes, whatever its size) and a subset of it, the contributors a reduced
slice used, as a bitmap (:func:`subset_bits`, one bit a member), not as
lists of 32-byte keys: at 256 members the lists were 9.8x the payload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol

import blake3
import msgpack

from .encoded import CodecError, Encoded, ITEMSIZE, payload_size

CHUNK = 1 << 20
DOMAIN = b"meshd-learn-v1\0"
MAX_GROUP = 256  # characters in a contribution's group
MAX_KIND = 64  # ... and in its kind
_HEADER = frozenset({"t", "codec", "dtype", "shape", "block", "bytes"})
_FIELDS = ("group", "round", "author", "kind", "samples", "digest")  # a contribution's


class WireError(ValueError):
    """Frames or a contribution from a peer are malformed or over a limit."""


@dataclass(frozen=True)
class Limits:
    """What one decoder accepts from a peer: tensors, payload bytes in all, name length, dimensions."""

    max_tensors: int = 10_000
    max_bytes: int = 8 << 30
    max_name: int = 256
    max_dims: int = 8


def header(name: str, enc: Encoded) -> dict:
    """The frame that announces tensor ``name`` (its payload follows in chunks)."""
    return {"t": name, "codec": enc.codec, "dtype": enc.dtype, "shape": list(enc.shape),
            "block": enc.block, "bytes": len(enc.payload)}


def frames(named: Iterable[tuple[str, Encoded]]) -> Iterator[dict]:
    """The frames that carry ``named`` ((name, Encoded) pairs), in order, made
    as they are taken: a header, then chunks of at most :data:`CHUNK` bytes."""
    for name, enc in named:
        yield header(name, enc)
        for chunk in _chunks(enc.payload):
            yield {"c": bytes(chunk)}


def _chunks(payload) -> Iterator[memoryview]:
    view = memoryview(payload).cast("B")
    for at in range(0, len(view), CHUNK):
        yield view[at:at + CHUNK]


# --- payloads that travel apart from their headers (meshd's bulk lane) ---------------------------
#
# A sender may send only the headers and lend the payloads elsewhere, as
# numbered chunks (every tensor's payload in CHUNK slices, in header order):
# the receiver feeds each header, then that tensor's chunks, to a Decoder.


def lent_chunks(named: Iterable[tuple[str, Encoded]]) -> list[memoryview]:
    """The payloads of ``named`` as the numbered chunks a receiver of its headers
    asks for (views, no copies: the payloads must not change while lent)."""
    return [chunk for _, enc in named for chunk in _chunks(enc.payload)]


def chunk_counts(headers: list, limits: Limits) -> list[int]:
    """How many lent chunks each of ``headers`` (a peer's header frames) is
    followed by; WireError if one is not a header with an integer size, or the
    sizes add up to more than the limits allow.  (The Decoder checks the rest
    of each header as it is fed.)"""
    if len(headers) > limits.max_tensors:
        raise WireError(f"more than {limits.max_tensors} tensors")
    sizes = []
    for frame in headers:
        size = frame.get("bytes") if isinstance(frame, dict) and "t" in frame else None
        if type(size) is not int or size < 0:
            raise WireError("a tensor header with its size in bytes was expected")
        sizes.append(size)
    if sum(sizes) > limits.max_bytes:
        raise WireError(f"more than {limits.max_bytes} bytes of tensors")
    return [-(-size // CHUNK) for size in sizes]


def chunk_ids(ticket: bytes, count: int) -> list[bytes]:
    """The 32-byte ids of ``count`` lent chunks, from the lender's random ``ticket``
    (so only those the ticket was given to can name them)."""
    return [blake3.blake3(ticket + j.to_bytes(8, "little")).digest() for j in range(count)]


class Sink(Protocol):
    """Takes a tensor's payload chunk by chunk, in order (``at``: the chunk's first byte)."""

    def write(self, at: int, chunk: memoryview) -> None: ...


Into = Callable[[str, str, int], "memoryview | Sink | None"]


class Decoder:
    """Rebuilds (name, Encoded) pairs from frames, checking each against the limits.

    ``into(name, codec, nbytes)``, if given, may return a writable buffer of
    exactly ``nbytes`` for a tensor's payload (a receiver's own, reused
    memory); the chunks are copied into it as they come and it becomes the
    payload.  It may instead return a :class:`Sink`: each chunk is handed to it
    as it comes and kept nowhere, and the sink stands for the payload.
    Otherwise (or if it returns None) the chunks are joined at the end.
    It does not hash what it decodes: every receiver takes a set straight
    from its author over a channel that authenticates every byte.  One that
    takes a copy passed on by someone else checks :func:`digest_of` the
    tensors it decoded against the signed digest.
    A decoder that raised has refused its stream; it is not fed again.
    """

    def __init__(self, limits: Limits = Limits(), *, into: Into | None = None):
        self.limits = limits
        self._into = into
        self._names: set[str] = set()
        self._total = 0
        self._head: dict | None = None
        self._parts: list[bytes] = []
        self._buffer: memoryview | None = None  # the payload's own buffer, from ``into``
        self._sink: Sink | None = None  # ... or where its chunks go, from ``into``
        self._have = 0

    def feed(self, frame: object) -> list[tuple[str, Encoded]]:
        """Take one frame; returns the tensors it completed (none or one).
        WireError for a frame of the wrong shape, order or size."""
        if not isinstance(frame, dict):
            raise WireError("a frame is a map")
        if frame.keys() == {"c"}:
            self._chunk(frame["c"])
        elif "t" in frame:
            if frame.keys() != _HEADER:
                raise WireError(f"a tensor header has the fields {', '.join(sorted(_HEADER))}")
            if self._head is not None:
                raise WireError(f"tensor {self._head['t']!r} ended early")
            self._start(frame)
        else:
            raise WireError("a frame is a tensor header or a payload chunk")
        return self._complete()

    def _chunk(self, chunk: object) -> None:
        if self._head is None:
            raise WireError("a payload chunk without a tensor header")
        if not isinstance(chunk, (bytes, bytearray, memoryview)) or not 0 < memoryview(chunk).nbytes <= CHUNK:
            raise WireError(f"a payload chunk is 1 to {CHUNK} bytes; an empty or bad one came")
        at, n = self._have, memoryview(chunk).nbytes
        self._have += n
        if self._have > self._head["bytes"]:
            raise WireError(f"tensor {self._head['t']!r} has more bytes than announced")
        if self._sink is not None:
            self._sink.write(at, memoryview(chunk).cast("B"))
        elif self._buffer is not None:
            self._buffer[at:at + n] = memoryview(chunk).cast("B")
        else:  # a chunk may be a view of a buffer its source reuses: keep a copy
            self._parts.append(chunk if isinstance(chunk, bytes) else bytes(chunk))

    def _start(self, head: dict) -> None:
        limits = self.limits
        name, shape = head["t"], head["shape"]
        if not isinstance(name, str) or not 0 < len(name) <= limits.max_name:
            raise WireError(f"a tensor name is 1-{limits.max_name} characters")
        if name in self._names:
            raise WireError(f"tensor {name!r} sent twice")
        if len(self._names) >= limits.max_tensors:
            raise WireError(f"more than {limits.max_tensors} tensors")
        if (not isinstance(shape, list) or len(shape) > limits.max_dims
                or not all(type(n) is int and n >= 0 for n in shape)):
            raise WireError(f"{name}: a shape is at most {limits.max_dims} non-negative integers")
        codec, dtype, block, size = head["codec"], head["dtype"], head["block"], head["bytes"]
        if (not isinstance(codec, str) or not isinstance(dtype, str) or dtype not in ITEMSIZE
                or type(block) is not int or type(size) is not int):
            raise WireError(f"{name}: codec is a name, dtype one of {', '.join(ITEMSIZE)}, "
                            "block and bytes integers")
        numel = math.prod(shape)
        if numel // 2 > limits.max_bytes:  # no codec takes less than half a byte a value
            raise WireError(f"{name}: {shape} is more than {limits.max_bytes} bytes")
        try:
            expected = payload_size(codec, dtype, numel, block)
        except CodecError as exc:
            raise WireError(f"{name}: {exc}") from None
        if size != expected:
            raise WireError(f"{name}: {codec} of {shape} {dtype} is {expected} bytes, not {size}")
        self._total += size
        if self._total > limits.max_bytes:
            raise WireError(f"more than {limits.max_bytes} bytes of tensors")
        self._names.add(name)
        self._head = {"t": name, "codec": codec, "dtype": dtype, "shape": tuple(shape), "block": block,
                      "bytes": size}
        buffer = self._into(name, codec, size) if self._into is not None and size else None
        if hasattr(buffer, "write"):
            self._sink = buffer
        elif buffer is not None and (buffer.readonly or buffer.nbytes != size):
            raise ValueError(f"into() gave {name!r} a buffer that is not {size} writable bytes")
        else:
            self._buffer = buffer

    def _complete(self) -> list[tuple[str, Encoded]]:
        head = self._head
        if head is None or self._have < head["bytes"]:
            return []
        payload = (self._sink if self._sink is not None else self._buffer if self._buffer is not None
                   else bytearray().join(self._parts))  # decoding may share it
        self._head, self._parts, self._buffer, self._sink, self._have = None, [], None, None, 0
        return [(head["t"], Encoded(head["codec"], head["dtype"], head["shape"], head["block"], payload))]

    def finish(self) -> None:
        """Raise WireError if the stream ended inside a tensor."""
        if self._head is not None:
            raise WireError(f"tensor {self._head['t']!r} ended early")


def roster_digest(members: list[bytes]) -> bytes:
    """blake3 over a roster's keys in its order (each with its length): the same list, the same 32 bytes."""
    hasher = blake3.blake3()
    for key in members:
        hasher.update(len(key).to_bytes(1, "little") + key)
    return hasher.digest()


def subset_bits(members: list[bytes], subset: Iterable[bytes]) -> bytes:
    """``subset`` of ``members`` as a bitmap: bit i (LSB first) of byte i // 8 set
    for ``members[i]``.  ValueError for a key not in ``members``."""
    index = {key: i for i, key in enumerate(members)}
    bits = bytearray((len(members) + 7) // 8)
    for key in subset:
        if key not in index:
            raise ValueError("the subset names a key that is not on the roster")
        bits[index[key] // 8] |= 1 << (index[key] % 8)
    return bytes(bits)


def subset_of(members: list[bytes], bits: object) -> list[bytes]:
    """The members (in roster order) that ``bits`` from :func:`subset_bits` names.
    ValueError unless it is bytes of the roster's length in bits, rounded up, with
    no bit set past the roster."""
    if not isinstance(bits, bytes) or len(bits) != (len(members) + 7) // 8:
        raise ValueError(f"a subset of {len(members)} members is {(len(members) + 7) // 8} bytes")
    if len(members) % 8 and bits[-1] >> (len(members) % 8):
        raise ValueError("the subset sets a bit past the roster")
    return [key for i, key in enumerate(members) if bits[i // 8] >> (i % 8) & 1]


def digest_of(named: Iterable[tuple[str, Encoded]], threads: int = 1) -> bytes:
    """blake3 over the tensors in name order: name, codec, dtype, shape, block, payload
    (on up to ``threads`` threads: the same digest for any count)."""
    hasher = blake3.blake3(max_threads=threads)
    for name, enc in sorted(named, key=lambda item: item[0]):
        header = msgpack.packb([name, enc.codec, enc.dtype, list(enc.shape), enc.block, len(enc.payload)])
        hasher.update(len(header).to_bytes(4, "little") + header)
        hasher.update(enc.payload)
    return hasher.digest()


@dataclass(frozen=True)
class Contribution:
    """Who sent which tensors (by digest) for which round of which group."""

    group: str
    round: int
    author: bytes  # the author's 32-byte public key
    kind: str  # what the tensors are: "params", "delta", ... (the caller's names)
    samples: int  # training samples behind them (a weight for averaging)
    digest: bytes  # digest_of the tensors

    def signed_bytes(self) -> bytes:
        """What the author signs: the domain prefix, then the fields as one msgpack array."""
        return DOMAIN + msgpack.packb([self.group, self.round, self.author, self.kind, self.samples, self.digest])

    def sign(self, sign: Callable[[bytes], bytes]) -> bytes:
        """The author's signature, made by ``sign`` (its private key's)."""
        return sign(self.signed_bytes())

    def verify(self, signature: object, verify: Callable[[bytes, bytes, bytes], bool]) -> bool:
        """Whether ``signature`` is the author's over this contribution, as
        ``verify(public_key, signature, data)`` checks it."""
        return isinstance(signature, bytes) and bool(verify(self.author, signature, self.signed_bytes()))

    def to_wire(self) -> dict:
        return {"group": self.group, "round": self.round, "author": self.author, "kind": self.kind,
                "samples": self.samples, "digest": self.digest}

    @classmethod
    def from_wire(cls, data: object) -> "Contribution":
        """A contribution from a peer's map; WireError unless it has exactly the
        fields of :meth:`to_wire`, each well formed."""
        if not isinstance(data, dict):
            raise WireError("a contribution is a map")
        missing = [key for key in _FIELDS if key not in data]
        if missing or len(data) != len(_FIELDS):
            raise WireError(f"a contribution has the fields {', '.join(_FIELDS)}; missing: {', '.join(missing)}")
        group, round_, author = data["group"], data["round"], data["author"]
        kind, samples, digest = data["kind"], data["samples"], data["digest"]
        if not isinstance(group, str) or not 0 < len(group) <= MAX_GROUP:
            raise WireError(f"a contribution's group is 1-{MAX_GROUP} characters")
        if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND:
            raise WireError(f"a contribution's kind is 1-{MAX_KIND} characters")
        if type(round_) is not int or round_ < 0 or type(samples) is not int or samples < 0:
            raise WireError("a contribution's round and samples are non-negative integers")
        if not isinstance(author, bytes) or len(author) != 32 or not isinstance(digest, bytes) or len(digest) != 32:
            raise WireError("a contribution's author and digest are 32 bytes")
        return cls(group, round_, author, kind, samples, digest)
