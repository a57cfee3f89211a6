"""Model shard format: layout, chunking, manifests, and round trips through torch and safetensors."""

from __future__ import annotations

import json
import struct

import blake3
import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd.services.shards import (
    CONTEXT,
    ChunkError,
    Manifest,
    ManifestError,
    chunk_ranges,
    chunks_changed,
    decode_manifest,
    decode_tensors,
    encode_tensors,
    sign_manifest,
    write_safetensors,
)
from meshd.services.shards.format import MAX_TOTAL_SIZE, _cut_lengths

from shards_signing import KEY, PUB, needs_torch, torch
OTHER = Ed25519PrivateKey.from_private_bytes(bytes(32))


def _sign(layout, name="tiny", version=1, created=1_700_000_000) -> Manifest:
    return sign_manifest(layout, name, version, sign=KEY.sign, public_key=PUB, created=created)


def _resign(fields: list) -> bytes:
    """A manifest with a body made of ``fields``, correctly signed: only the checks can refuse it."""
    body = msgpack.packb(fields, use_bin_type=True)
    return msgpack.packb([body, KEY.sign(CONTEXT + body)], use_bin_type=True)


def _write_st(path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A hand-made .safetensors file, its tensors stored in reverse name order."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in sorted(tensors, reverse=True):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name in sorted(tensors, reverse=True):
            f.write(tensors[name][2])


SMALL = {  # name: (dtype, shape, bytes) -- no torch needed
    "w": ("F32", [4, 8], bytes(range(128))),
    "b": ("F32", [8], bytes(32)),
    "n": ("I64", [], (7).to_bytes(8, "little")),
    "e": ("BF16", [0, 3], b""),
    "m": ("BOOL", [3], b"\x01\x00\x01"),
}


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.safetensors"
    _write_st(path, SMALL)
    layout, chunks = encode_tensors(path, chunk_size=64)
    return layout, chunks, _sign(layout)


# ---- chunking and layout ----

def test_layout_of_a_file_is_in_name_order_and_cut_at_tensor_boundaries(small):
    layout, chunks, manifest = small
    assert [t.name for t in layout.tensors] == ["b", "e", "m", "n", "w"]
    assert b"".join(chunks) == b"".join(SMALL[t.name][2] for t in layout.tensors)
    # b (32) + e (0) + m (3) + n (8) packed; w (128) cut into two exact pieces
    assert [c.length for c in layout.chunks] == [43, 64, 64]
    assert [c.id for c in layout.chunks] == [blake3.blake3(c).digest() for c in chunks]
    assert chunk_ranges(manifest) == [(0, 43), (43, 64), (107, 64)]
    assert layout.total_size == manifest.total_size == 171


@given(st.lists(st.integers(0, 300), max_size=30), st.integers(1, 100))
def test_cut_lengths_respect_tensor_boundaries(lengths, chunk_size):
    cuts = _cut_lengths(lengths, chunk_size)
    assert sum(cuts) == sum(lengths) and all(0 < c <= chunk_size for c in cuts)
    starts, offset = {}, 0
    for n in lengths:
        starts[offset] = max(starts.get(offset, 0), n)
        offset += n
    edges = {0, offset} | {s + n for s, n in starts.items()}
    pos = 0
    for c in cuts:
        # every cut starts at a tensor boundary, or inside a large tensor at a multiple of chunk_size
        inside = [s for s, n in starts.items() if n > chunk_size and s < pos < s + n]
        assert pos in edges or (inside and (pos - inside[0]) % chunk_size == 0)
        if inside:  # a piece of a large tensor holds nothing else
            assert pos + c <= inside[0] + starts[inside[0]]
        pos += c


@needs_torch
def test_large_tensors_split_into_exact_pieces_small_ones_packed():
    tensors = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(4), "c": torch.arange(8, dtype=torch.uint8),
               "d": torch.randn(100), "e": torch.zeros(3, dtype=torch.int8)}
    layout, chunks = encode_tensors(tensors, chunk_size=64)
    assert [c.length for c in layout.chunks] == [64] + [64] * 6 + [16, 3]
    stream = b"".join(chunks)
    for t in layout.tensors:
        assert stream[t.offset:t.offset + t.length] == bytes(tensors[t.name].view(torch.uint8).tolist())
    assert [c.id for c in layout.chunks] == [blake3.blake3(c).digest() for c in chunks]


@needs_torch
def test_second_version_with_ten_percent_changed_sends_about_ten_percent():
    gen = torch.Generator().manual_seed(1)
    v1 = {f"layer{i:02d}.weight": torch.randn(64, 64, generator=gen) for i in range(20)}
    v1 |= {f"layer{i:02d}.bias": torch.randn(64, generator=gen) for i in range(20)}
    v2 = dict(v1)
    for i in (3, 11):  # 2 of 20 weight matrices: 10% of the large tensors
        v2[f"layer{i:02d}.weight"] = v1[f"layer{i:02d}.weight"] + 1
    old, new = (_sign(encode_tensors(v, chunk_size=4096)[0], version=n) for n, v in ((1, v1), (2, v2)))
    sizes = {c.id: c.length for c in new.chunks}
    changed = sum(sizes[i] for i in chunks_changed(old, new))
    assert changed == 2 * 64 * 64 * 4  # exactly the two matrices: the biases sit in their own chunks
    assert 0.09 < changed / new.total_size < 0.11
    assert chunks_changed(None, new) == list(dict.fromkeys(c.id for c in new.chunks))
    assert chunks_changed(new, new) == []


# ---- torch round trips ----

@needs_torch
def test_model_round_trip_gives_identical_outputs():
    def model():
        return torch.nn.Sequential(
            torch.nn.Embedding(50, 16),
            torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True),
            torch.nn.LayerNorm(16), torch.nn.Linear(16, 50)).eval()

    torch.manual_seed(0)
    original = model()
    layout, chunks = encode_tensors(original.state_dict(), chunk_size=1024)
    manifest = decode_manifest(_sign(layout).encode())
    store = dict(zip((c.id for c in manifest.chunks), chunks))
    torch.manual_seed(1)
    fresh = model()
    fresh.load_state_dict(decode_tensors(manifest, store), strict=True)
    x = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        assert torch.equal(original(x), fresh(x))
    assert len(manifest.chunks) > 5


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@needs_torch
def test_dtypes_empty_and_0d_tensors_survive_bit_exactly():
    f = torch.tensor([1.5, -0.0, float("nan"), float("inf"), 1e-40])
    tensors = {
        "f32": f, "f16": f.half(), "bf16": f.bfloat16(), "f64": f.double(), "i64": torch.tensor([-(2**62), 5]),
        "i32": torch.tensor([-7], dtype=torch.int32), "i16": torch.tensor([300], dtype=torch.int16),
        "i8": torch.tensor([-128], dtype=torch.int8), "u8": torch.tensor([255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3), "empty_bf16": torch.zeros(4, 0).bfloat16(),
        "scalar": torch.tensor(2.5), "scalar_i64": torch.tensor(-3), "scalar_bool": torch.tensor(True),
        "transposed": torch.arange(12.0).reshape(3, 4).t(), "param": torch.nn.Parameter(torch.randn(3)),
    }
    layout, chunks = encode_tensors(tensors, chunk_size=16)
    out = decode_tensors(_sign(layout), dict(zip((c.id for c in layout.chunks), chunks)))
    assert out.keys() == tensors.keys()
    for name, t in tensors.items():
        assert (out[name].dtype, out[name].shape) == (t.dtype, t.shape), name
        assert torch.equal(_bits(out[name]), _bits(t)), name


@needs_torch
def test_tensor_buffers_assemble_chunks_in_any_order_in_place():
    """A fetch to memory fills the tensors chunk by chunk in whatever order they arrive:
    packed small tensors, a large tensor's pieces (each written in its place), the same
    chunk twice (two equal tensors), empty and 0-d tensors; the result is bit-exact."""
    from meshd.services.shards.format import TensorBuffers
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(40, generator=gen)  # 160 bytes: ten 16-byte pieces of its own
    tensors = {"a.big": big, "b.twin": big.clone(), "c.small": torch.tensor([1, 2], dtype=torch.int16),
               "d.mask": torch.tensor([True, False]), "e.empty": torch.zeros(0, 3), "f.scalar": torch.tensor(2.5),
               "g.bf16": torch.randn(3, generator=gen).bfloat16()}
    layout, chunks = encode_tensors(tensors, chunk_size=16)
    by_id = dict(zip((c.id for c in layout.chunks), chunks))
    assert len(by_id) < len(layout.chunks)  # the twin's pieces are the big tensor's
    buffers = TensorBuffers(layout)
    placed = 0
    for cid in reversed(list(by_id)):
        place = buffers.place(cid, len(by_id[cid]))
        if place is None:
            buffers.fill(cid, by_id[cid])
        else:
            place[:] = by_id[cid]
            placed += 1
    assert placed == 0  # every piece of the big tensor is also the twin's: none has one place
    out = buffers.tensors
    assert out.keys() == tensors.keys()
    for name, t in tensors.items():
        assert (out[name].dtype, out[name].shape) == (t.dtype, t.shape), name
        assert torch.equal(_bits(out[name]), _bits(t)), name

    layout, chunks = encode_tensors({"big": big, "s1": torch.tensor([7]), "s2": torch.tensor([8])}, chunk_size=16)
    buffers = TensorBuffers(layout)
    places = [buffers.place(c.id, c.length) for c in layout.chunks]
    assert [p is not None for p in places] == [True] * 10 + [False]  # s1 and s2 share the last chunk
    assert buffers.place(layout.chunks[0].id, 15) is None  # not the length the manifest says
    for place, data in zip(places, chunks):
        if place is not None:
            place[:] = data
    buffers.fill(layout.chunks[-1].id, chunks[-1])
    out = buffers.tensors
    assert torch.equal(out["big"], big) and (out["s1"].tolist(), out["s2"].tolist()) == ([7], [8])


def test_a_file_written_chunk_by_chunk_in_any_order_is_write_safetensors_file(small, tmp_path):
    from meshd.services.shards.format import SafetensorsFile
    layout, chunks, manifest = small
    by_id = dict(zip((c.id for c in layout.chunks), chunks))
    write_safetensors(manifest, by_id, tmp_path / "whole.safetensors")
    with SafetensorsFile(manifest, tmp_path / "pieces.safetensors") as out:
        assert not (tmp_path / "pieces.safetensors").exists()  # .part until whole
        for cid in reversed(list(by_id)):
            out.fill(cid, by_id[cid])
    assert (tmp_path / "pieces.safetensors").read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
    with pytest.raises(ChunkError):  # a bad chunk: no file, no part left
        write_safetensors(manifest, {**by_id, layout.chunks[0].id: b"x" * layout.chunks[0].length},
                          tmp_path / "bad.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pieces.safetensors", "small.safetensors",
                                                         "whole.safetensors"]


@needs_torch
def test_empty_state_dict():
    layout, chunks = encode_tensors({})
    manifest = _sign(layout)
    assert (manifest.total_size, manifest.chunks, chunks) == (0, (), [])
    assert decode_tensors(decode_manifest(manifest.encode()), {}) == {}


# ---- safetensors files ----

def _save_file(tensors, path):
    """safetensors.torch.save_file, or what it does, where numpy (which it needs) is missing."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        from safetensors import TensorSpec, serialize_file
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        serialize_file({k: TensorSpec(dtype=str(v.dtype).split(".")[-1], shape=list(v.shape), data_ptr=v.data_ptr(),
                                      data_len=v.numel() * v.element_size()) for k, v in tensors.items()}, path)
    else:
        from safetensors.torch import save_file
        save_file(tensors, path)


@needs_torch
def test_safetensors_file_and_memory_give_the_same_model(tmp_path):
    gen = torch.Generator().manual_seed(2)
    tensors = {"z.weight": torch.randn(40, 30, generator=gen), "a.bias": torch.randn(7, generator=gen).bfloat16(),
               "m.ids": torch.arange(9), "m.mask": torch.tensor([True, False]), "s": torch.tensor(1.0).half(),
               "empty": torch.zeros(0, 2)}
    path = tmp_path / "in.safetensors"
    _save_file(tensors, path)
    from_file, file_chunks = encode_tensors(path, chunk_size=512)
    from_memory, memory_chunks = encode_tensors(tensors, chunk_size=512)
    assert from_file.tensors == from_memory.tensors and file_chunks == memory_chunks  # the same chunks
    assert from_file.chunks == from_memory.chunks
    # the library stores them by dtype, then name: the file keeps its header, the state_dict has none
    data = path.read_bytes()
    assert from_file.header == data[8:8 + struct.unpack("<Q", data[:8])[0]] and from_memory.header is None
    assert _sign(from_file).id != _sign(from_memory).id


@needs_torch
def test_write_safetensors_loads_with_the_safetensors_package(tmp_path):
    from safetensors.torch import load_file
    tensors = {"w": torch.randn(33, 5).bfloat16(), "i": torch.arange(-3, 3), "s": torch.tensor(False),
               "e": torch.zeros(2, 0, dtype=torch.int16), "h": torch.randn(4).half()}
    layout, chunks = encode_tensors(tensors, chunk_size=32)
    manifest = _sign(layout)
    out = tmp_path / "out.safetensors"
    write_safetensors(manifest, dict(zip((c.id for c in layout.chunks), chunks)).get, out)
    loaded = load_file(out)
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape
        assert torch.equal(_bits(loaded[name]), _bits(t))
    assert encode_tensors(out, chunk_size=32) == (layout, chunks)


def test_write_then_read_a_file_without_torch(small, tmp_path):
    layout, chunks, manifest = small
    out = tmp_path / "copy.safetensors"
    write_safetensors(manifest, dict(zip((c.id for c in layout.chunks), chunks)), out)
    assert encode_tensors(out, chunk_size=64) == (layout, chunks)
    assert not (tmp_path / "copy.safetensors.part").exists()


BAD_ENTRY = b'{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}    '  # 4 bytes for 8; no data


@pytest.mark.parametrize("header", [b"", b"\xff" * 8, struct.pack("<Q", 2) + b"[]",
                                    struct.pack("<Q", len(BAD_ENTRY)) + BAD_ENTRY])
def test_malformed_safetensors_files_are_refused(tmp_path, header):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(header)
    with pytest.raises(ValueError):
        encode_tensors(path)


# ---- corrupted and missing chunks ----

def test_bad_or_missing_chunks_are_detected(small, tmp_path):
    layout, chunks, manifest = small
    store = dict(zip((c.id for c in layout.chunks), chunks))
    bad = dict(store)
    bad[layout.chunks[1].id] = bytes([chunks[1][0] ^ 1]) + chunks[1][1:]
    short = dict(store)
    short[layout.chunks[2].id] = chunks[2][:-1]
    missing = dict(store)
    del missing[layout.chunks[0].id]
    for source in (bad, short, missing, missing.__getitem__):
        with pytest.raises(ChunkError):
            write_safetensors(manifest, source, tmp_path / "x.safetensors")
        assert list(tmp_path.iterdir()) == [tmp_path / "small.safetensors"]
        if torch is not None:
            with pytest.raises(ChunkError):
                decode_tensors(manifest, source)


# ---- manifests ----

def test_sign_and_decode_round_trip(small):
    layout, _, manifest = small
    assert decode_manifest(manifest.encode()) == manifest
    assert manifest.id == blake3.blake3(manifest.body()).digest()
    assert (manifest.name, manifest.version, manifest.created, manifest.publisher) == ("tiny", 1, 1_700_000_000, PUB)
    assert (manifest.tensors, manifest.chunks, manifest.chunk_size) == (layout.tensors, layout.chunks, 64)
    assert _sign(layout, version=2).id != manifest.id
    with pytest.raises(ManifestError, match="signature"):
        sign_manifest(layout, "tiny", 1, sign=OTHER.sign, public_key=PUB)


def test_every_flipped_byte_is_refused(small):
    data = small[2].encode()
    for i in range(len(data)):
        for mask in (0x01, 0x80, 0xFF):
            flipped = bytearray(data)
            flipped[i] ^= mask
            with pytest.raises(ManifestError):
                decode_manifest(bytes(flipped))


def _fields(manifest: Manifest) -> list:
    return msgpack.unpackb(manifest.body(), raw=False)


def _mutate(fields, where, value):
    fields = [list(f) if isinstance(f, list) else f for f in fields]
    if where[0] in (7, 8) and fields[where[0]] and len(where) > 1:
        entries = fields[where[0]] = [list(e) for e in fields[where[0]]]
        entries[where[1] % len(entries)][where[2] % len(entries[0])] = value
    else:
        fields[where[0]] = value
    return fields


@pytest.mark.parametrize("where, value, message", [
    ((0,), 3, "version 1 or 2"), ((0,), True, "version 1 or 2"), ((0,), 1, "version-1 body has 9"),
    ((1,), "", "name"), ((1,), "x" * 257, "name"),
    ((2,), -1, "non-negative"), ((4,), b"k" * 31, "publisher"), ((5,), 0, "chunk_size"),
    ((6,), MAX_TOTAL_SIZE + 1, "total_size"), ((6,), 170, "runs past"), ((7, 0, 0), "z", "sorted"),
    ((7, 0, 1), "F128", "dtype"), ((7, 0, 2), [-8], "shape"), ((7, 0, 2), [4.0], "shape"), ((7, 1, 3), 0, "start at"),
    ((7, 0, 4), 31, "length"), ((8, 0, 1), 65, "chunk"), ((8, 0, 0), b"short", "chunk"), ((8,), [], "add up"),
    ((7, 4, 0), "__metadata__", "tensor name"),
])
def test_bad_fields_are_refused_even_when_signed(small, where, value, message):
    with pytest.raises(ManifestError, match=message):
        decode_manifest(_resign(_mutate(_fields(small[2]), where, value)))


def test_chunks_must_follow_the_format_cut(small):
    fields = _fields(small[2])
    ids = [c[0] for c in fields[8]]
    fields[8] = [[ids[0], 43], [ids[1], 32], [ids[2], 64], [ids[2], 32]]  # w cut 32 + 64 + 32
    with pytest.raises(ManifestError, match="tensor boundaries"):
        decode_manifest(_resign(fields))


def test_non_canonical_encodings_are_refused(small):
    fields = _fields(small[2])
    body = msgpack.packb(fields, use_bin_type=True)
    padded = body[:1] + b"\xcd\x00" + body[1:2] + body[2:]  # the format version as a uint16
    assert msgpack.unpackb(padded) == msgpack.unpackb(body)
    with pytest.raises(ManifestError, match="canonical"):
        decode_manifest(msgpack.packb([padded, KEY.sign(CONTEXT + padded)], use_bin_type=True))


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=70),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=20)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _decode_or_manifest_error(data) -> None:
    try:
        manifest = decode_manifest(data)
    except ManifestError:
        return
    assert manifest.encode() == data


@FUZZ
@given(st.binary(max_size=600))
def test_garbage_bytes_raise_only_manifest_error(data):
    _decode_or_manifest_error(data)


@FUZZ
@given(msgpack_values)
def test_garbage_msgpack_raises_only_manifest_error(value):
    _decode_or_manifest_error(msgpack.packb(value, use_bin_type=True))
    _decode_or_manifest_error(msgpack.packb([msgpack.packb(value, use_bin_type=True), bytes(64)]))
    _decode_or_manifest_error(_resign(value if isinstance(value, list) else [value]))


@FUZZ
@given(st.tuples(st.integers(0, 9), st.integers(0, 10), st.integers(0, 10)), msgpack_values)
def test_mutated_signed_fields_raise_only_manifest_error(small, where, value):
    _decode_or_manifest_error(_resign(_mutate(_fields(small[2]), where, value)))


@FUZZ
@given(st.data())
def test_mutated_bytes_raise_only_manifest_error(small, data):
    encoded = bytearray(small[2].encode())
    for _ in range(data.draw(st.integers(1, 4))):
        encoded[data.draw(st.integers(0, len(encoded) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(encoded)))
    _decode_or_manifest_error(bytes(encoded[:cut]))
    if bytes(encoded) != small[2].encode():
        with pytest.raises(ManifestError):
            decode_manifest(bytes(encoded))


def test_total_size_limit_is_checked_before_cutting():
    fields = [1, "huge", 1, 0, PUB, 1, MAX_TOTAL_SIZE, [["w", "U8", [MAX_TOTAL_SIZE], 0, MAX_TOTAL_SIZE]],
              [[bytes(32), 1]]]
    with pytest.raises(ManifestError, match="add up"):
        decode_manifest(_resign(fields))
