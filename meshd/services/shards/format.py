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

The manifest, on the wire::

    manifest = msgpack [body, signature]
    body     = msgpack [FORMAT_VERSION, name, version, created, publisher,
                        chunk_size, total_size,
                        [[tensor name, dtype, shape, offset, length], ...],
                        [[chunk id, length], ...]]

``signature`` is the publisher's Ed25519 signature of ``CONTEXT + body``; the
model id is blake3(body).  Both layers must be canonical msgpack (re-encoding
the decoded value gives the same bytes), so a manifest has exactly one
encoding.  Nothing here unpickles; torch is imported only when tensors are.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import time
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping, NamedTuple, Union

import blake3
import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

if TYPE_CHECKING:
    import torch

CONTEXT = b"meshd-shard-manifest/1"
FORMAT_VERSION = 1
CHUNK_SIZE = 4 << 20  # default
MAX_CHUNK_SIZE = 64 << 20
MAX_TENSORS = 100_000
MAX_CHUNKS = 1_000_000
MAX_NAME = 256  # bytes of a model name
MAX_TENSOR_NAME = 1024  # bytes of a tensor name
MAX_DIMS = 64
MAX_TOTAL_SIZE = 1 << 40
MAX_MANIFEST = 64 << 20  # bytes of an encoded manifest
MAX_SAFETENSORS_HEADER = 100 << 20
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
    format_version: int = FORMAT_VERSION

    def body(self) -> bytes:
        """The canonical msgpack of every field but the signature: what is signed."""
        return self._body

    @cached_property
    def _body(self) -> bytes:
        return _pack([self.format_version, self.name, self.version, self.created, self.publisher,
                      self.chunk_size, self.total_size, self.tensors, self.chunks])

    def encode(self) -> bytes:
        """The wire form, msgpack ``[body, signature]``."""
        return _pack([self.body(), self.signature])

    @cached_property
    def id(self) -> bytes:
        """The model id: blake3(body), 32 bytes."""
        return blake3.blake3(self.body()).digest()


def encode_tensors(source: Mapping[str, "torch.Tensor"] | str | os.PathLike,
                   chunk_size: int = CHUNK_SIZE) -> tuple[Layout, list[bytes]]:
    """Lay out and cut tensors (a state_dict, or a ``.safetensors`` file's path).

    Returns the layout and the chunk bytes, in stream order.  The same tensors
    give the same layout whichever way they come in; a file is read without
    torch.  Raises TypeError/ValueError for a tensor or file that cannot be
    encoded (an unsupported dtype, a malformed safetensors header).
    """
    if type(chunk_size) is not int or not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be an int from 1 to {MAX_CHUNK_SIZE}")
    if isinstance(source, (str, os.PathLike)):
        specs, blobs = _read_safetensors(source)
    else:
        specs, blobs = _read_torch(source)
    tensors, offset = [], 0
    for name, dtype, shape in specs:
        length = math.prod(shape) * DTYPE_SIZES[dtype]
        tensors.append(TensorEntry(name, dtype, shape, offset, length))
        offset += length
    chunks = list(_cut(blobs, _cut_lengths([t.length for t in tensors], chunk_size)))
    entries = tuple(ChunkEntry(blake3.blake3(c).digest(), len(c)) for c in chunks)
    return Layout(chunk_size, offset, tuple(tensors), entries), chunks


def sign_manifest(layout: Layout, name: str, version: int, *, sign: Callable[[bytes], bytes],
                  public_key: bytes, created: int | None = None) -> Manifest:
    """Sign ``layout`` as ``name`` ``version``; ``sign`` is the publisher's Ed25519 signer.

    ``created`` defaults to now.  The result went through :func:`decode_manifest`,
    so ManifestError means peers would refuse it too (a limit, a wrong key).
    """
    created = int(time.time()) if created is None else created
    unsigned = Manifest(name, version, created, public_key, layout.chunk_size, layout.total_size,
                        layout.tensors, layout.chunks, b"")
    try:
        body = unsigned.body()
    except (ValueError, TypeError, OverflowError) as exc:
        raise ManifestError(f"cannot encode the manifest: {exc}") from None
    return decode_manifest(_pack([body, sign(CONTEXT + body)]))


def decode_manifest(data: bytes, *, verify: bool = True) -> Manifest:
    """Parse, check and (with ``verify``) signature-check a manifest from a peer.

    Every field is checked: types, limits, dtypes, shapes against lengths,
    tensors contiguous in name order covering ``total_size``, chunk lengths
    equal to the format's cut, canonical encoding.  Raises only ManifestError.
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
    _require(isinstance(fields, list) and len(fields) == 9, "expected a body of 9 fields")
    fmt, name, version, created, publisher, chunk_size, total_size, tensors, chunks = fields
    _require(type(fmt) is int and fmt == FORMAT_VERSION, f"not a version-{FORMAT_VERSION} manifest")
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
    manifest = Manifest(name, version, created, publisher, chunk_size, total_size, tuple(entries),
                        tuple(ChunkEntry(c[0], c[1]) for c in chunks), sig)
    _require(manifest.body() == body and manifest.encode() == data, "manifest is not canonical msgpack")
    if verify:
        try:
            Ed25519PublicKey.from_public_bytes(publisher).verify(sig, CONTEXT + body)
        except (InvalidSignature, ValueError):
            raise ManifestError("signature does not verify") from None
    return manifest


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


def write_safetensors(manifest: Manifest, chunks: ChunkSource, path: str | os.PathLike) -> None:
    """Write the model to ``path`` as a ``.safetensors`` file, without torch.

    Chunks are verified as they are written; the file appears (atomically
    replacing ``path``) only once all of them were good.
    """
    header = {"__metadata__": {"format": "pt"}}
    for t in manifest.tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.offset, t.offset + t.length]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    part = f"{os.fspath(path)}.part"
    fetch = _fetcher(chunks)
    try:
        with open(part, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for entry in manifest.chunks:
                f.write(fetch(entry))
        os.replace(part, path)
    except BaseException:
        if os.path.exists(part):
            os.unlink(part)
        raise


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


def _cut(blobs: Iterable[bytes], cuts: list[int]) -> Iterator[bytes]:
    """Chunks of the given lengths from the concatenation of ``blobs``."""
    lengths = iter(cuts)
    need, parts, have = next(lengths, 0), [], 0
    for blob in blobs:
        view = memoryview(blob)
        while len(view):
            if not need:
                raise ValueError("tensor data is longer than its shape and dtype say")
            take = min(need - have, len(view))
            parts.append(view[:take])
            view, have = view[take:], have + take
            if have == need:
                yield b"".join(parts)
                need, parts, have = next(lengths, 0), [], 0
    if need:
        raise ValueError("tensor data is shorter than its shape and dtype say")


def _read_torch(tensors: Mapping[str, "torch.Tensor"]):
    torch = _torch()
    if sys.byteorder != "little":
        raise ValueError("shards are little-endian; this host is not")
    names = {getattr(torch, t, None): k for k, (_, t) in DTYPES.items()}
    items = sorted(tensors.items(), key=lambda kv: kv[0])
    specs = []
    for name, t in items:
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError("expected a mapping of str names to torch tensors")
        if t.dtype not in names or t.layout != torch.strided:
            raise TypeError(f"tensor {name!r}: {t.dtype} {t.layout} cannot go in a shard")
        specs.append((name, names[t.dtype], tuple(t.shape)))

    def blobs() -> Iterator[bytearray]:
        for _, t in items:
            flat = t.detach().to("cpu").contiguous().reshape(-1)
            out = bytearray(flat.numel() * flat.element_size())
            if out:
                torch.frombuffer(out, dtype=torch.uint8).copy_(flat.view(torch.uint8))
            yield out

    return specs, blobs()


def _read_safetensors(path: str | os.PathLike):
    """The specs of a .safetensors file's tensors, sorted by name, and their bytes in that order."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) != 8 or not (n := struct.unpack("<Q", prefix)[0]) <= min(MAX_SAFETENSORS_HEADER, size - 8):
            raise ValueError(f"{path}: not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ValueError(f"{path}: the safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    specs, ranges = [], []
    for name in sorted(k for k in header if k != "__metadata__"):
        info = header[name]
        ok = (isinstance(info, dict) and info.get("dtype") in DTYPE_SIZES
              and isinstance(shape := info.get("shape"), list) and all(type(d) is int and d >= 0 for d in shape)
              and isinstance(span := info.get("data_offsets"), list) and len(span) == 2
              and all(type(x) is int for x in span) and 0 <= span[0] <= span[1] <= data_len
              and span[1] - span[0] == math.prod(shape) * DTYPE_SIZES[info["dtype"]])
        if not ok:
            raise ValueError(f"{path}: bad safetensors entry for tensor {name!r}")
        specs.append((name, info["dtype"], tuple(shape)))
        ranges.append(span)

    def blobs() -> Iterator[bytes]:
        with open(path, "rb") as f:
            for begin, end in ranges:
                f.seek(data_start + begin)
                yield f.read(end - begin)

    return specs, blobs()


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
