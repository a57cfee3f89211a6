"""Model shards: a state_dict as content-addressed chunks under a signed manifest.

The stream.  A model's tensors, sorted by name (str order, which is UTF-8 byte
order), are laid end to end with no padding, each as its raw little-endian
bytes in C order: the data section of a ``.safetensors`` file, in name order.
Each tensor has a safetensors dtype ("F32", "BF16", "BOOL", ...), a shape and a
byte range; 0-d tensors hold one element, empty tensors an empty range.

Chunks.  The stream is cut at tensor boundaries by one greedy pass in name
order: consecutive tensors of at most ``chunk_size`` bytes are packed into one
chunk while they fit; a tensor larger than ``chunk_size`` is cut into pieces of
exactly ``chunk_size`` bytes (the last one shorter) and shares no chunk with
another tensor.  A tensor unchanged between two versions therefore yields the
same chunks, unless another tensor packed with it changed.  A chunk's id is
blake3(chunk), 32 bytes.  Decoders recompute the cut from the tensor table and
refuse a manifest whose chunk lengths differ from it.

Files.  A model published from a ``.safetensors`` file keeps the file's header
(the JSON after the 8-byte length, padding included: ``__metadata__``, key
order, the tensors' offsets in the file) in its manifest, so the file written
from it is the file published, byte for byte; the stream stays in name order
whatever order the file stores its tensors in, and the writer puts each
tensor's bytes back at its offset in the file.  A file whose header is exactly
the one :func:`write_safetensors` makes for a state_dict (see
:func:`_canonical_header`) needs none, and gives the state_dict's manifest.

The manifest, on the wire::

    manifest = msgpack [body, signature]
    body     = msgpack [1, name, version, created, publisher, chunk_size, total_size,
                        [[tensor name, dtype, shape, offset, length], ...],
                        [[chunk id, length], ...]]
             | msgpack [2, ...the same 8 fields..., header]

Version 2 is version 1 plus ``header``, the file's header bytes (at most
``MAX_HEADER``; it must describe exactly the tensors of the table, stored
back to back in some order).  A manifest with no header is written as
version 1, so the ids of state_dict models and of manifests made before
version 2 do not change.  ``signature`` is the publisher's Ed25519 signature
of ``CONTEXT + body``; the model id is blake3(body).  Both layers must be
canonical msgpack (re-encoding the decoded value gives the same bytes), so a
manifest has exactly one encoding.  Nothing here unpickles; torch is imported
only when tensors are.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import struct
import sys
import time
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping, NamedTuple, Protocol, Union

import blake3
import msgpack
from dht.records import signed_by

if TYPE_CHECKING:
    import torch

CONTEXT = b"meshd-shard-manifest/1"
FORMAT_VERSION = 2  # the newest; a manifest that carries no file header is written as version 1
_BODY_FIELDS = {1: 9, 2: 10}  # fields of a body, by format version
CHUNK_SIZE = 4 << 20  # default
MAX_CHUNK_SIZE = 64 << 20
MAX_TENSORS = 100_000
MAX_CHUNKS = 1_000_000
MAX_NAME = 256  # bytes of a model name
MAX_TENSOR_NAME = 1024  # bytes of a tensor name
MAX_DIMS = 64
MAX_TOTAL_SIZE = 1 << 40
MAX_MANIFEST = 64 << 20  # bytes of an encoded manifest
MAX_HEADER = 8 << 20  # bytes of a .safetensors header, in a file we publish or in a manifest
ID_SIZE = KEY_SIZE = 32
SIGNATURE_SIZE = 64
_MAX_INT = 1 << 63

# safetensors dtype name -> (bytes per element, torch dtype name)
DTYPES = {"F64": (8, "float64"), "F32": (4, "float32"), "F16": (2, "float16"), "BF16": (2, "bfloat16"),
          "I64": (8, "int64"), "I32": (4, "int32"), "I16": (2, "int16"), "I8": (1, "int8"),
          "U64": (8, "uint64"), "U32": (4, "uint32"), "U16": (2, "uint16"), "U8": (1, "uint8"),
          "BOOL": (1, "bool"), "F8_E4M3": (1, "float8_e4m3fn"), "F8_E5M2": (1, "float8_e5m2")}
DTYPE_SIZES = {name: size for name, (size, _) in DTYPES.items()}

ChunkSource = Union[Mapping[bytes, bytes], Callable[[bytes], bytes]]


class ManifestError(ValueError):
    """A manifest that is malformed, over a limit, inconsistent or wrongly signed."""


class ChunkError(ValueError):
    """A chunk that is missing or whose bytes do not match the manifest."""


class TensorEntry(NamedTuple):
    name: str
    dtype: str  # safetensors name, a key of DTYPE_SIZES
    shape: tuple[int, ...]
    offset: int  # in the stream
    length: int  # bytes


class ChunkEntry(NamedTuple):
    id: bytes  # blake3 of the chunk
    length: int


@dataclass(frozen=True)
class Layout:
    """What :func:`encode_tensors` computes: a manifest without its signed fields."""

    chunk_size: int
    total_size: int
    tensors: tuple[TensorEntry, ...]
    chunks: tuple[ChunkEntry, ...]
    header: bytes | None = None  # the source file's .safetensors header, if it needs one


@dataclass(frozen=True)
class Manifest:
    """A signed manifest; trust one only from :func:`decode_manifest` or :func:`sign_manifest`."""

    name: str
    version: int
    created: int  # unix seconds
    publisher: bytes  # Ed25519 public key
    chunk_size: int
    total_size: int
    tensors: tuple[TensorEntry, ...]
    chunks: tuple[ChunkEntry, ...]
    signature: bytes
    header: bytes | None = None  # the published file's .safetensors header (format version 2)

    @property
    def format_version(self) -> int:
        """1, or 2 for a manifest that carries a file header."""
        return 1 if self.header is None else 2

    @cached_property
    def metadata(self) -> dict[str, str] | None:
        """The published file's ``__metadata__``, or None (a state_dict, or a file without one)."""
        return None if self.header is None else parse_header(self.header)[0]

    def body(self) -> bytes:
        """The canonical msgpack of every field but the signature: what is signed."""
        return self._body

    @cached_property
    def _body(self) -> bytes:
        fields = [self.format_version, self.name, self.version, self.created, self.publisher,
                  self.chunk_size, self.total_size, self.tensors, self.chunks]
        return _pack(fields if self.header is None else [*fields, self.header])

    def encode(self) -> bytes:
        """The wire form, msgpack ``[body, signature]``."""
        return _pack([self.body(), self.signature])

    @cached_property
    def id(self) -> bytes:
        """The model id: blake3(body), 32 bytes."""
        return blake3.blake3(self.body()).digest()


class Encoder:
    """A source's tensors laid out in name order and about to be cut into chunks.

    What :func:`encode_tensors` (and a publish that stores chunks as they are
    made) works from: ``tensors``, ``header``, ``total_size`` and the chunk
    ``lengths`` are known before any tensor is read; :meth:`chunks` then reads
    the tensors and yields each chunk as a new bytearray, so holding one chunk
    at a time costs one chunk of memory.  Open one with :func:`open_encoder`;
    close it (or use ``with``) to close the source file.
    """

    def __init__(self, source: "_Source", chunk_size: int) -> None:
        self._source = source
        self.chunk_size = chunk_size
        tensors, offset = [], 0
        for name, dtype, shape in source.specs:
            length = math.prod(shape) * DTYPE_SIZES[dtype]
            tensors.append(TensorEntry(name, dtype, shape, offset, length))
            offset += length
        self.tensors: tuple[TensorEntry, ...] = tuple(tensors)
        self.total_size = offset
        self.lengths = _cut_lengths([t.length for t in tensors], chunk_size)
        raw = source.header
        self.header = None if raw is None or raw == _canonical_header(self.tensors) else raw

    def chunks(self) -> Iterator[bytearray]:
        """The chunks' bytes, in stream order, each read when asked for."""
        lengths, fill = [t.length for t in self.tensors], self._source.fill
        i = off = 0  # the tensor being read and the bytes of it read so far
        for size in self.lengths:
            buf = bytearray(size)
            view, pos = memoryview(buf), 0
            while pos < size:
                while off == lengths[i]:
                    i, off = i + 1, 0
                take = min(size - pos, lengths[i] - off)
                fill(i, off, view[pos:pos + take])
                pos, off = pos + take, off + take
            view.release()
            yield buf

    def layout(self, chunk_ids: Iterable[bytes]) -> Layout:
        """The layout, given the blake3 id of each chunk in order."""
        chunks = tuple(ChunkEntry(cid, n) for cid, n in zip(chunk_ids, self.lengths, strict=True))
        return Layout(self.chunk_size, self.total_size, self.tensors, chunks, self.header)

    def close(self) -> None:
        self._source.close()

    def __enter__(self) -> "Encoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_encoder(source: Mapping[str, "torch.Tensor"] | str | os.PathLike,
                 chunk_size: int = CHUNK_SIZE) -> Encoder:
    """An :class:`Encoder` over a state_dict or a ``.safetensors`` file's path.

    A file is read without torch; its header is checked as :func:`parse_header`
    says and must describe exactly the bytes after it (no gap, no overlap,
    nothing left over), as the reference implementation requires.  Raises
    TypeError/ValueError for a tensor or file that cannot be encoded (an
    unsupported dtype, a malformed or too large header), OSError for a file
    that cannot be read.
    """
    if type(chunk_size) is not int or not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be an int from 1 to {MAX_CHUNK_SIZE}")
    if isinstance(source, (str, os.PathLike)):
        src: _Source = _FileSource(source)
    else:
        src = _TorchSource(source)
    try:
        return Encoder(src, chunk_size)
    except BaseException:
        src.close()
        raise


def encode_tensors(source: Mapping[str, "torch.Tensor"] | str | os.PathLike,
                   chunk_size: int = CHUNK_SIZE) -> tuple[Layout, list[bytearray]]:
    """Lay out and cut tensors (a state_dict, or a ``.safetensors`` file's path).

    Returns the layout and the chunk bytes, in stream order: the whole model in
    memory (a publish streams through :func:`open_encoder` instead).  The same
    tensors give the same chunks whichever way they come in; a file whose
    header :func:`write_safetensors` would not make keeps it in the layout.
    Raises as :func:`open_encoder` does.
    """
    with open_encoder(source, chunk_size) as encoder:
        chunks = list(encoder.chunks())
    return encoder.layout(blake3.blake3(c).digest() for c in chunks), chunks


def sign_manifest(layout: Layout, name: str, version: int, *, sign: Callable[[bytes], bytes],
                  public_key: bytes, created: int | None = None) -> Manifest:
    """Sign ``layout`` as ``name`` ``version``; ``sign`` is the publisher's Ed25519 signer.

    ``created`` defaults to now.  The result went through :func:`decode_manifest`,
    so ManifestError means peers would refuse it too (a limit, a wrong key).
    """
    created = int(time.time()) if created is None else created
    unsigned = Manifest(name, version, created, public_key, layout.chunk_size, layout.total_size,
                        layout.tensors, layout.chunks, b"", layout.header)
    try:
        body = unsigned.body()
    except (ValueError, TypeError, OverflowError) as exc:
        raise ManifestError(f"cannot encode the manifest: {exc}") from None
    return decode_manifest(_pack([body, sign(CONTEXT + body)]))


def decode_manifest(data: bytes, *, verify: bool = True) -> Manifest:
    """Parse, check and (with ``verify``) signature-check a manifest from a peer.

    Every field is checked: types, limits, dtypes, shapes against lengths,
    tensors contiguous in name order covering ``total_size``, chunk lengths
    equal to the format's cut, a file header that parses and describes exactly
    these tensors, canonical encoding.  Raises only ManifestError.
    """
    _require(isinstance(data, bytes) and len(data) <= MAX_MANIFEST,
             f"a manifest is at most {MAX_MANIFEST} bytes")
    try:
        outer = _unpack(data)
        _require(isinstance(outer, list) and len(outer) == 2, "expected [body, signature]")
        body, sig = outer
        _require(isinstance(body, bytes) and _is_bytes(sig, SIGNATURE_SIZE),
                 "expected a bytes body and a 64-byte signature")
        fields = _unpack(body)
    except ManifestError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise ManifestError(f"undecodable manifest: {exc}") from None
    _require(isinstance(fields, list) and len(fields) > 0 and type(fields[0]) is int
             and fields[0] in _BODY_FIELDS, "not a manifest of format version 1 or 2")
    _require(len(fields) == _BODY_FIELDS[fields[0]],
             f"a version-{fields[0]} body has {_BODY_FIELDS[fields[0]]} fields")
    fmt, name, version, created, publisher, chunk_size, total_size, tensors, chunks = fields[:9]
    header = fields[9] if fmt == 2 else None
    _require(isinstance(name, str) and 0 < len(name.encode()) <= MAX_NAME,
             f"the model name is 1 to {MAX_NAME} bytes of text")
    _require(_is_int(version) and _is_int(created), "version and created are non-negative ints")
    _require(_is_bytes(publisher, KEY_SIZE), "the publisher is a 32-byte key")
    _require(type(chunk_size) is int and 0 < chunk_size <= MAX_CHUNK_SIZE,
             f"chunk_size is 1 to {MAX_CHUNK_SIZE}")
    _require(type(total_size) is int and 0 <= total_size <= MAX_TOTAL_SIZE,
             f"total_size is 0 to {MAX_TOTAL_SIZE}")
    _require(isinstance(tensors, list) and len(tensors) <= MAX_TENSORS, f"at most {MAX_TENSORS} tensors")
    _require(isinstance(chunks, list) and len(chunks) <= MAX_CHUNKS, f"at most {MAX_CHUNKS} chunks")
    entries, offset, prev = [], 0, ""
    for item in tensors:
        _require(isinstance(item, list) and len(item) == 5, "a tensor is [name, dtype, shape, offset, length]")
        tname, dtype, shape, toff, tlen = item
        _require(isinstance(tname, str) and 0 < len(tname.encode()) <= MAX_TENSOR_NAME
                 and tname != "__metadata__", f"a tensor name is 1 to {MAX_TENSOR_NAME} bytes of text")
        _require(tname > prev, "tensor names must be distinct and sorted")
        _require(isinstance(dtype, str) and dtype in DTYPE_SIZES, f"tensor {tname!r}: unknown dtype")
        _require(isinstance(shape, list) and len(shape) <= MAX_DIMS
                 and all(type(d) is int and 0 <= d <= MAX_TOTAL_SIZE for d in shape),
                 f"tensor {tname!r}: a shape is at most {MAX_DIMS} non-negative ints")
        _require(type(toff) is int and toff == offset, f"tensor {tname!r} must start at byte {offset}")
        _require(type(tlen) is int and tlen == math.prod(shape) * DTYPE_SIZES[dtype],
                 f"tensor {tname!r}: length does not match dtype and shape")
        offset += tlen
        _require(offset <= total_size, f"tensor {tname!r} runs past total_size")
        entries.append(TensorEntry(tname, dtype, tuple(shape), toff, tlen))
        prev = tname
    _require(offset == total_size, "the tensors do not cover total_size")
    covered = 0
    for item in chunks:
        _require(isinstance(item, list) and len(item) == 2 and _is_bytes(item[0], ID_SIZE)
                 and type(item[1]) is int and 0 < item[1] <= chunk_size,
                 "a chunk is [32-byte id, length from 1 to chunk_size]")
        covered += item[1]
    _require(covered == total_size, "chunk lengths do not add up to total_size")
    _require([c[1] for c in chunks] == _cut_lengths([t.length for t in entries], chunk_size),
             "chunks are not cut at tensor boundaries as the format requires")
    if fmt == 2:
        _check_header(header, entries)
    manifest = Manifest(name, version, created, publisher, chunk_size, total_size, tuple(entries),
                        tuple(ChunkEntry(c[0], c[1]) for c in chunks), sig, header)
    _require(manifest.body() == body and manifest.encode() == data, "manifest is not canonical msgpack")
    if verify:
        if not signed_by(publisher, sig, CONTEXT + body):
            raise ManifestError("signature does not verify")
    return manifest


def _check_header(header: object, tensors: list[TensorEntry]) -> None:
    """ManifestError unless ``header`` is a header of exactly ``tensors`` (in any order)."""
    _require(isinstance(header, bytes) and 0 < len(header) <= MAX_HEADER,
             f"a file header is 1 to {MAX_HEADER} bytes")
    try:
        _, in_file = parse_header(header)
    except ValueError as exc:
        raise ManifestError(f"bad file header: {exc}") from None
    described = sorted((t.name, t.dtype, t.shape, t.length) for t in in_file)
    _require(described == [(t.name, t.dtype, t.shape, t.length) for t in tensors],
             "the file header does not describe the manifest's tensors")


def verify_chunk(entry: ChunkEntry, data: object) -> bytes:
    """``data`` as bytes if it is the chunk ``entry`` names; ChunkError otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ChunkError(f"chunk {entry.id.hex()[:16]} is missing")
    data = bytes(data)
    if len(data) != entry.length or blake3.blake3(data).digest() != entry.id:
        raise ChunkError(f"chunk {entry.id.hex()[:16]} does not match its id")
    return data


def iter_tensor_bytes(manifest: Manifest, chunks: ChunkSource) -> Iterator[tuple[TensorEntry, bytearray]]:
    """Each tensor's entry and bytes, in order, from chunks verified as they are fetched.

    ``chunks`` maps a chunk id to its bytes, or is a function doing so (returning
    None or raising KeyError when it has none).  Holds one chunk at a time.
    """
    fetch = _fetcher(chunks)
    pending = iter(manifest.chunks)
    view, pos = memoryview(b""), 0
    for entry in manifest.tensors:
        buf, filled = bytearray(entry.length), 0
        while filled < entry.length:
            if pos == len(view):
                view, pos = memoryview(fetch(next(pending))), 0
            take = min(entry.length - filled, len(view) - pos)
            buf[filled:filled + take] = view[pos:pos + take]
            filled, pos = filled + take, pos + take
        yield entry, buf


def decode_tensors(manifest: Manifest, chunks: ChunkSource) -> dict[str, "torch.Tensor"]:
    """The manifest's tensors as CPU torch tensors, ready for ``load_state_dict``.

    Every chunk is checked against its id first; ChunkError on a missing or bad one.
    """
    torch = _torch()
    out = {}
    for entry, data in iter_tensor_bytes(manifest, chunks):
        dtype = getattr(torch, DTYPES[entry.dtype][1])
        flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        out[entry.name] = flat.reshape(entry.shape)
    return out


def _chunk_pieces(manifest: Manifest | Layout) -> dict[bytes, list[tuple[int, int, int, int]]]:
    """Where each chunk's bytes go: by chunk id, ``(tensor index, offset in that tensor,
    offset in the chunk, length)`` per piece, every place it appears (a chunk may pack
    several small tensors, and the same bytes may appear twice)."""
    places: dict[bytes, list[tuple[int, int, int, int]]] = {}
    tensors, i, off = manifest.tensors, 0, 0  # tensor i, of which off bytes are placed
    for chunk in manifest.chunks:
        pieces, pos = places.setdefault(chunk.id, []), 0
        while pos < chunk.length:
            while off == tensors[i].length:
                i, off = i + 1, 0
            take = min(chunk.length - pos, tensors[i].length - off)
            pieces.append((i, off, pos, take))
            pos, off = pos + take, off + take
    return places


class TensorBuffers:
    """A model's tensors, allocated empty and filled in place one verified chunk at a
    time, in any order (what a fetch to memory assembles, with no second copy of the model).

    Each tensor is a plain ``torch.empty`` CPU tensor of its own (aligned, resizable, as
    ``load_state_dict`` expects), or, given ``into`` (a state_dict of exactly the model's
    tensors, each contiguous, on the CPU, of its dtype and shape: a model's own
    parameters, say), that tensor, overwritten in place.  :meth:`fill` copies a chunk's bytes to every place the
    manifest puts them.  Calls for different chunks may run in different threads at
    once: they write disjoint bytes.
    """

    def __init__(self, manifest: Manifest | Layout, into: Mapping[str, "torch.Tensor"] | None = None) -> None:
        torch = _torch()
        if into is not None and set(into) != {t.name for t in manifest.tensors}:
            names = {t.name for t in manifest.tensors}
            raise ValueError(f"into must hold exactly the model's tensors: missing {sorted(names - set(into))[:5]}, "
                             f"unexpected {sorted(set(into) - names)[:5]}")
        self.tensors: dict[str, "torch.Tensor"] = {}
        views = []
        for t in manifest.tensors:
            dtype = getattr(torch, DTYPES[t.dtype][1])
            if into is None:
                tensor = torch.empty(t.shape, dtype=dtype)
            else:
                tensor = into[t.name]
                if (tensor.dtype, tuple(tensor.shape), tensor.device.type) != (dtype, t.shape, "cpu") \
                        or not tensor.is_contiguous():
                    raise ValueError(f"into[{t.name!r}]: expected a contiguous CPU tensor of {dtype} and shape "
                                     f"{t.shape}, not {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
            self.tensors[t.name] = tensor
            views.append(_writable(tensor, t.length))
        # chunk id -> (tensor's bytes, offset there, offset in the chunk, length) per piece
        self._places = {cid: [(views[i], off, src, n) for i, off, src, n in pieces]
                        for cid, pieces in _chunk_pieces(manifest).items()}

    def fill(self, chunk_id: bytes, data: bytes | bytearray | memoryview) -> None:
        """Copy chunk ``chunk_id`` (verified by the caller) wherever the manifest puts it."""
        data = memoryview(data)
        for view, dst, src, n in self._places[chunk_id]:
            view[dst:dst + n] = data[src:src + n]

    def place(self, chunk_id: bytes, length: int) -> memoryview | None:
        """Where chunk ``chunk_id`` of ``length`` bytes can be written in one piece, so
        that nothing is left to copy: its bytes in the one tensor it belongs to (a piece
        of a large tensor).  None if it spans tensors, appears twice or is not ``length``
        bytes long.  Bytes written there before the chunk is verified are garbage until
        it is (or a later copy is) verified and written."""
        pieces = self._places.get(chunk_id)
        if not pieces or len(pieces) != 1 or pieces[0][3] != length:
            return None
        view, dst, _, n = pieces[0]
        return view[dst:dst + n]


def _writable(tensor: "torch.Tensor", length: int) -> memoryview:
    """The bytes of a new contiguous CPU tensor, writable in place (no numpy needed); valid
    while the tensor lives."""
    if not length:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * length).from_address(tensor.data_ptr())).cast("B")


class SafetensorsFile:
    """A model's ``.safetensors`` file, written one verified chunk at a time in any order
    (``path.part`` until :meth:`commit` renames it to ``path``; :meth:`abort`, or leaving
    a ``with`` block by an exception, removes it).

    A model published from a file comes back as that file, byte for byte: its header
    verbatim, each tensor at its offset.  Otherwise the header is
    :func:`_canonical_header`'s (``{"format": "pt"}`` metadata, tensors in name order).
    :meth:`fill` writes a chunk wherever the file holds its bytes (``pwrite``: calls for
    different chunks may run in different threads at once).  Written through the page
    cache, not fsynced.
    """

    def __init__(self, manifest: Manifest | Layout, path: str | os.PathLike) -> None:
        header, begins = _file_layout(manifest)
        start = 8 + len(header)
        self.path, self.part = os.fspath(path), f"{os.fspath(path)}.part"
        # chunk id -> (offset in the file, offset in the chunk, length) per run of bytes
        self._places: dict[bytes, list[tuple[int, int, int]]] = {}
        for cid, pieces in _chunk_pieces(manifest).items():
            runs = self._places[cid] = []
            for i, off, src, n in pieces:
                at = start + begins[i] + off
                if runs and runs[-1][0] + runs[-1][2] == at and runs[-1][1] + runs[-1][2] == src:
                    runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)  # where the file is the stream
                else:
                    runs.append((at, src, n))
        self._file = open(self.part, "wb")
        try:
            self._file.write(struct.pack("<Q", len(header)) + header)
            self._file.truncate(start + manifest.total_size)
            self._file.flush()
        except BaseException:
            self.abort()
            raise

    def fill(self, chunk_id: bytes, data: bytes | bytearray | memoryview) -> None:
        """Write chunk ``chunk_id`` (verified by the caller) wherever the file holds it."""
        data, fd = memoryview(data), self._file.fileno()
        for at, src, n in self._places[chunk_id]:
            _pwrite(fd, data[src:src + n], at)

    def commit(self) -> None:
        """Close the file and give it its name (atomically replacing what was there)."""
        self._file.close()
        os.replace(self.part, self.path)

    def abort(self) -> None:
        self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.part)

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()


def write_safetensors(manifest: Manifest | Layout, chunks: ChunkSource, path: str | os.PathLike) -> None:
    """Write the model to ``path`` as a ``.safetensors`` file, without torch (see
    :class:`SafetensorsFile`).  Chunks are verified as they are written, one at a time;
    the file appears (atomically replacing ``path``) only once all of them were good.
    """
    fetch = _fetcher(chunks)
    with SafetensorsFile(manifest, path) as out:
        for entry in {c.id: c for c in manifest.chunks}.values():
            out.fill(entry.id, fetch(entry))


def parse_header(raw: bytes) -> tuple[dict[str, str] | None, list[TensorEntry]]:
    """The ``__metadata__`` and the tensors of a ``.safetensors`` header.

    ``raw`` is the header as in the file: the JSON after its 8-byte length,
    padding included.  Tensors come in the header's order, each with its
    ``offset`` in the file's data section.  ValueError (saying what) unless it
    is at most ``MAX_HEADER`` bytes of UTF-8 JSON: an object with no repeated
    key; ``__metadata__`` (optional) a map of strings to strings; every other
    key a tensor name of 1 to ``MAX_TENSOR_NAME`` bytes, mapped to exactly
    ``{"dtype", "shape", "data_offsets"}`` with a dtype of ``DTYPES``, a shape
    of at most ``MAX_DIMS`` non-negative ints and ``[begin, end]`` as long as
    dtype and shape say; at most ``MAX_TENSORS`` tensors, stored back to back
    from 0 in some order (the reference implementation refuses a file with a
    gap or an overlap).  The data section is as long as the tensors' ends say.
    """
    if not isinstance(raw, (bytes, bytearray)) or len(raw) > MAX_HEADER:
        raise ValueError(f"a header is at most {MAX_HEADER} bytes")
    try:
        header = json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=_json_object,
                            parse_constant=_json_constant)
    except RecursionError:
        raise ValueError("the header nests too deep") from None
    except ValueError as exc:  # also UnicodeDecodeError, and the hooks' refusals
        raise ValueError(f"the header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise ValueError("__metadata__ must map strings to strings")
    if len(header) - ("__metadata__" in header) > MAX_TENSORS:
        raise ValueError(f"at most {MAX_TENSORS} tensors")
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not 0 < len(name.encode("utf-8", "replace")) <= MAX_TENSOR_NAME:
            raise ValueError(f"a tensor name is 1 to {MAX_TENSOR_NAME} bytes")
        ok = (isinstance(info, dict) and info.keys() == _ENTRY_KEYS
              and isinstance(info["dtype"], str) and info["dtype"] in DTYPE_SIZES
              and isinstance(shape := info["shape"], list) and len(shape) <= MAX_DIMS
              and all(type(d) is int and 0 <= d <= MAX_TOTAL_SIZE for d in shape)
              and isinstance(span := info["data_offsets"], list) and len(span) == 2
              and all(type(x) is int for x in span) and 0 <= span[0] <= span[1]
              and span[1] - span[0] == math.prod(shape) * DTYPE_SIZES[info["dtype"]])
        if not ok:
            raise ValueError(f"bad entry for tensor {name[:100]!r}: expected {{dtype, shape, data_offsets}} "
                             f"with a known dtype, a shape of ints and offsets as long as they say")
        tensors.append(TensorEntry(name, info["dtype"], tuple(shape), span[0], span[1] - span[0]))
    end = 0
    for t in sorted(tensors, key=lambda t: (t.offset, t.length)):
        if t.offset != end:
            raise ValueError(f"tensor {t.name[:100]!r} starts at byte {t.offset} of the data, not {end}: "
                             f"tensors must be stored back to back")
        end += t.length
    return (None if metadata is None else dict(metadata)), tensors


_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


def _json_object(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a key is repeated")
    return out


def _json_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _canonical_header(tensors: Iterable[TensorEntry]) -> bytes:
    """The header :func:`write_safetensors` makes for a model that came with none:
    ``{"format": "pt"}`` metadata, the tensors in name order as the stream holds
    them, compact JSON padded with spaces to a multiple of 8 bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.offset, t.offset + t.length]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _file_layout(manifest: Manifest | Layout) -> tuple[bytes, list[int]]:
    """The header of the model's file, and where each tensor (in manifest order) starts
    in its data section."""
    if manifest.header is None:
        return _canonical_header(manifest.tensors), [t.offset for t in manifest.tensors]
    begins = {t.name: t.offset for t in parse_header(manifest.header)[1]}
    return manifest.header, [begins[t.name] for t in manifest.tensors]


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def chunk_ranges(manifest: Manifest | Layout) -> list[tuple[int, int]]:
    """Each chunk's ``(offset, length)`` in the stream, in manifest order."""
    ranges, offset = [], 0
    for chunk in manifest.chunks:
        ranges.append((offset, chunk.length))
        offset += chunk.length
    return ranges


def chunks_changed(old: Manifest | Layout | None, new: Manifest | Layout) -> list[bytes]:
    """Ids of ``new``'s chunks that ``old`` lacks, distinct, in stream order: what to fetch."""
    have = {c.id for c in old.chunks} if old is not None else set()
    out = []
    for chunk in new.chunks:
        if chunk.id not in have:
            have.add(chunk.id)
            out.append(chunk.id)
    return out


def _cut_lengths(lengths: Iterable[int], chunk_size: int) -> list[int]:
    """The format's chunk lengths for tensors of these byte lengths (see the module docstring)."""
    cuts, packed = [], 0
    for n in lengths:
        if n > chunk_size:
            if packed:
                cuts.append(packed)
                packed = 0
            full, rest = divmod(n, chunk_size)
            cuts += [chunk_size] * full + ([rest] if rest else [])
        elif packed + n > chunk_size:
            cuts.append(packed)
            packed = n
        else:
            packed += n
    return cuts + [packed] if packed else cuts


class _Source(Protocol):
    """Tensors to encode: their specs in name order, and their bytes on demand."""

    specs: list[tuple[str, str, tuple[int, ...]]]  # (name, dtype, shape), sorted by name
    header: bytes | None  # a file's header, as in the file

    def fill(self, index: int, offset: int, dest: memoryview) -> None:
        """Copy bytes ``offset:offset + len(dest)`` of tensor ``index`` into ``dest``."""

    def close(self) -> None: ...


class _TorchSource:
    """A state_dict.  Its tensors are copied a chunk's piece at a time (a GPU
    tensor too); a tensor that is not contiguous is first made so, whole."""

    header = None

    def __init__(self, tensors: Mapping[str, "torch.Tensor"]) -> None:
        torch = self._torch = _torch()
        if sys.byteorder != "little":
            raise ValueError("shards are little-endian; this host is not")
        names = {getattr(torch, t, None): k for k, (_, t) in DTYPES.items()}
        self._items = sorted(tensors.items(), key=lambda kv: kv[0])
        self.specs = []
        for name, t in self._items:
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise TypeError("expected a mapping of str names to torch tensors")
            if t.dtype not in names or t.layout != torch.strided:
                raise TypeError(f"tensor {name!r}: {t.dtype} {t.layout} cannot go in a shard")
            self.specs.append((name, names[t.dtype], tuple(t.shape)))
        self._flat: tuple[int, "torch.Tensor"] | None = None  # the tensor being read, as bytes

    def fill(self, index: int, offset: int, dest: memoryview) -> None:
        if self._flat is None or self._flat[0] != index:
            t = self._items[index][1].detach()
            self._flat = (index, t.contiguous().reshape(-1).view(self._torch.uint8))
        piece = self._flat[1][offset:offset + len(dest)]
        self._torch.frombuffer(dest, dtype=self._torch.uint8).copy_(piece)

    def close(self) -> None:
        self._flat = None


class _FileSource:
    """A ``.safetensors`` file, read without torch; see :func:`open_encoder`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._file = open(path, "rb", buffering=0)
        try:
            self._open(os.fspath(path))
        except BaseException:
            self._file.close()
            raise

    def _open(self, path: str) -> None:
        f = self._file
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) != 8 or (n := struct.unpack("<Q", prefix)[0]) > size - 8:
            raise ValueError(f"{path}: not a safetensors file (bad header length)")
        if n > MAX_HEADER:
            raise ValueError(f"{path}: its header has {n} bytes; a manifest carries at most {MAX_HEADER}")
        raw = f.read(n)
        if len(raw) != n:
            raise ValueError(f"{path}: the file got shorter while being read")
        try:
            _, tensors = parse_header(raw)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        data = sum(t.length for t in tensors)
        if data != size - 8 - n:
            raise ValueError(f"{path}: its tensors hold {data} bytes but {size - 8 - n} follow the header")
        tensors.sort(key=lambda t: t.name)
        self.header, self._start = raw, 8 + n
        self.specs = [(t.name, t.dtype, t.shape) for t in tensors]
        self._begins = [t.offset for t in tensors]

    def fill(self, index: int, offset: int, dest: memoryview) -> None:
        pos = self._start + self._begins[index] + offset
        while dest:
            n = os.preadv(self._file.fileno(), [dest], pos)
            if not n:
                raise ValueError("the file got shorter while being read")
            dest, pos = dest[n:], pos + n

    def close(self) -> None:
        self._file.close()


def _fetcher(chunks: ChunkSource) -> Callable[[ChunkEntry], bytes]:
    """A function from a chunk entry to its verified bytes, out of ``chunks``."""
    get = chunks if callable(chunks) else chunks.get

    def fetch(entry: ChunkEntry) -> bytes:
        try:
            data = get(entry.id)
        except KeyError:
            data = None
        return verify_chunk(entry, data)

    return fetch


def _torch():
    try:
        import torch
    except ImportError:
        raise ImportError("tensors need torch: pip install 'meshd[torch]'") from None
    return torch


def _refuse_ext(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack extension type {code} is not accepted")


def _pack(value: object) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _unpack(data: bytes) -> object:
    return msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_refuse_ext,
                           max_bin_len=MAX_MANIFEST, max_str_len=MAX_MANIFEST,
                           max_array_len=MAX_CHUNKS, max_map_len=0, max_ext_len=0)


def _is_int(value: object) -> bool:
    return type(value) is int and 0 <= value < _MAX_INT


def _is_bytes(value: object, size: int) -> bool:
    return isinstance(value, bytes) and len(value) == size


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ManifestError(message)
