"""Faithful files: a ``.safetensors`` file published and written back is that file, byte for
byte (header, ``__metadata__``, key order, padding, the order of the tensors' bytes), and the
file header a manifest carries, which comes from peers, is checked: a malformed one raises
only ManifestError."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd.services.shards import (
    CONTEXT,
    Manifest,
    ManifestError,
    decode_manifest,
    encode_tensors,
    sign_manifest,
    write_safetensors,
)
from meshd.services.shards import format as fmt
from meshd.services.shards.format import parse_header

from shards_signing import KEY, PUB, needs_torch, torch


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def publish_and_write(path, out, chunk_size: int = 64) -> Manifest:
    """Publish ``path`` as a peer receives it (signed, encoded, decoded), then write it at ``out``."""
    layout, chunks = encode_tensors(path, chunk_size=chunk_size)
    sent = sign_manifest(layout, "file", 1, sign=KEY.sign, public_key=PUB, created=1_700_000_000)
    manifest = decode_manifest(sent.encode())
    write_safetensors(manifest, dict(zip((c.id for c in manifest.chunks), chunks)).get, out)
    return manifest


def resign(fields: list) -> bytes:
    body = msgpack.packb(fields, use_bin_type=True)
    return msgpack.packb([body, KEY.sign(CONTEXT + body)], use_bin_type=True)


TENSORS = {  # name: (dtype, shape, bytes); no torch needed
    "w": ("F32", [4, 8], bytes(range(128))),
    "b": ("F32", [8], bytes(range(100, 132))),
    "n": ("I64", [], (7).to_bytes(8, "little")),
    "e": ("BF16", [0, 3], b""),
    "m": ("BOOL", [3], b"\x01\x00\x01"),
    "é.scale": ("F16", [2], b"\x00\x3c\x00\xc0"),
}


def hand_made(path, *, keys: list[str], data_order: list[str], metadata: dict | None = None,
              metadata_at: int = 0, padding: bytes = b"", **dumps) -> bytes:
    """A .safetensors file whose header lists ``keys`` in that order (``__metadata__`` at
    ``metadata_at``), dumped with ``json.dumps(**dumps)`` and ``padding`` after it, with the
    tensors' bytes stored in ``data_order``.  Returns the file's bytes."""
    offsets, at = {}, 0
    for name in data_order:
        offsets[name] = [at, at + len(TENSORS[name][2])]
        at += len(TENSORS[name][2])
    items = [(k, {"dtype": TENSORS[k][0], "shape": TENSORS[k][1], "data_offsets": offsets[k]}) for k in keys]
    if metadata is not None:
        items.insert(metadata_at, ("__metadata__", metadata))
    raw = json.dumps(dict(items), **dumps).encode() + padding
    data = struct.pack("<Q", len(raw)) + raw + b"".join(TENSORS[k][2] for k in data_order)
    path.write_bytes(data)
    return data


NAMES = sorted(TENSORS)
HAND_MADE = {
    # metadata last, pretty-printed, bytes in neither header nor name order, 5 spaces of padding
    "pretty, metadata last": dict(keys=["w", "m", "b", "é.scale", "n", "e"],
                                  data_order=["m", "é.scale", "w", "e", "n", "b"],
                                  metadata={"step": "1200", "format": "pt", "note": "a\nb \u00e9"}, metadata_at=6,
                                  indent=2, padding=b" " * 5),
    # no metadata, compact, raw UTF-8, names in reverse order, no padding (a length not a multiple of 8)
    "compact, no metadata": dict(keys=NAMES[::-1], data_order=NAMES[::-1], separators=(",", ":"),
                                 ensure_ascii=False),
    # metadata in the middle, names sorted but bytes reversed, tabs and newlines as padding
    "metadata in the middle": dict(keys=NAMES, data_order=NAMES[::-1], metadata={"format": "pt", "z": ""},
                                   metadata_at=3, padding=b"\t\n\r "),
    # exactly the header write_safetensors makes for a state_dict but for the metadata
    "canonical but for metadata": dict(keys=NAMES, data_order=NAMES, metadata={"format": "np"},
                                       separators=(",", ":"), padding=b" " * 3),
}


@pytest.mark.parametrize("case", HAND_MADE)
def test_a_hand_made_file_comes_back_byte_for_byte(tmp_path, case):
    source, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    original = hand_made(source, **HAND_MADE[case])
    manifest = publish_and_write(source, out)
    assert out.read_bytes() == original and sha256(out) == sha256(source)
    assert manifest.format_version == 2 and manifest.header == original[8:8 + len(manifest.header)]
    assert manifest.metadata == HAND_MADE[case].get("metadata")
    # the stream is in name order whatever the file's order: the chunks are the same as ever
    assert [t.name for t in manifest.tensors] == NAMES
    assert b"".join(TENSORS[n][2] for n in NAMES) == b"".join(
        dict(zip((c.id for c in manifest.chunks), encode_tensors(source, chunk_size=64)[1]))[c.id]
        for c in manifest.chunks)


@pytest.mark.parametrize("case", HAND_MADE)
def test_a_file_written_as_chunks_arrive_in_any_order_comes_back_byte_for_byte(tmp_path, case):
    """What a fetch with an output file does: each chunk is written where the file holds its
    bytes when it lands, in whatever order (here: last first, 8-byte chunks spanning tensors)."""
    source, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    original = hand_made(source, **HAND_MADE[case])
    layout, chunks = encode_tensors(source, chunk_size=8)
    manifest = decode_manifest(sign_manifest(layout, "file", 1, sign=KEY.sign, public_key=PUB).encode())
    with fmt.SafetensorsFile(manifest, out) as file:
        for cid, data in reversed(list(zip((c.id for c in manifest.chunks), chunks))):
            file.fill(cid, data)
    assert out.read_bytes() == original


@needs_torch
@pytest.mark.parametrize("chunk_size", [64, 4 << 20])
def test_a_file_saved_by_safetensors_comes_back_byte_for_byte(tmp_path, chunk_size):
    pytest.importorskip("numpy")  # safetensors.torch.save_file needs it
    from safetensors.torch import load_file, save_file
    gen = torch.Generator().manual_seed(3)
    tensors = {"z.weight": torch.randn(40, 30, generator=gen), "a.bias": torch.randn(7, generator=gen).bfloat16(),
               "m.ids": torch.arange(9), "m.mask": torch.tensor([True, False]), "s": torch.tensor(1.0).half(),
               "empty": torch.zeros(0, 2), "b.big": torch.randn(300, generator=gen)}
    source, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(tensors, source, metadata={"step": "1200", "format": "pt"})
    manifest = publish_and_write(source, out, chunk_size)
    assert sha256(out) == sha256(source)
    assert manifest.metadata == {"step": "1200", "format": "pt"}
    in_file = [t.name for t in parse_header(manifest.header)[1]]
    assert in_file != sorted(in_file)  # the library stores them by dtype, then name: not the stream's order
    loaded = load_file(out)
    for name, t in tensors.items():
        assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    # the same chunks as the state_dict gives: a file and its state_dict share what they store and send
    assert encode_tensors(tensors, chunk_size)[0].chunks == manifest.chunks


def test_a_file_write_safetensors_made_is_published_as_its_state_dict(tmp_path):
    source, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    hand_made(source, **HAND_MADE["compact, no metadata"])
    first = publish_and_write(source, out)
    plain = dataclasses.replace(encode_tensors(source)[0], header=None)  # as if from a state_dict
    plain_file = tmp_path / "plain.safetensors"
    write_safetensors(plain, dict(zip((c.id for c in plain.chunks), encode_tensors(source)[1])), plain_file)
    again = encode_tensors(plain_file)[0]
    assert again == plain and again.header is None  # no header needed: the manifest stays version 1
    assert first.tensors == again.tensors


# A version-1 manifest made before version 2 existed (of the hand-made file of test_shards_format.py,
# read the old way: no header), signed with KEY.
OLD_MANIFEST = bytes.fromhex(
    "92c4db9901a474696e7901ce6553f100c42003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b840ccab"
    "9595a162a34633329108002095a165a442463136920003200095a16da4424f4f4c9103200395a16ea349363490230895a177a34633"
    "329204082bcc809392c420b8d222e82d73a82bb6c44f570fdd1ad4fe558cbe9aaba167bc8416d9489cb0652b92c4204eed7141ea4a"
    "5cd4b788606bd23f46e212af9cacebacdc7d1f4c6dc7f2511b984092c420397ddf2e45df83a8f23fd15aa718efb0bb7c9da2b2e430"
    "69ab9dd0270c37c9ea40c4409fd030cff4997a8070d367427bfdbf9f447941eae435ed0a616b7ba7692ecffb05bd3d273dcbea3021"
    "0ed22d3292d87ef6f8f7567e03b54a5595a6460dfa9f01")
OLD_ID = "aeeaaf5aa95407aa0287778e61c7fa40869894e7601a4f409c88079cae013227"


def test_manifests_made_before_version_2_still_decode_with_the_same_id():
    manifest = decode_manifest(OLD_MANIFEST)
    assert manifest.id.hex() == OLD_ID and manifest.format_version == 1 and manifest.header is None
    assert manifest.encode() == OLD_MANIFEST and manifest.metadata is None
    layout = fmt.Layout(manifest.chunk_size, manifest.total_size, manifest.tensors, manifest.chunks)
    resigned = sign_manifest(layout, "tiny", 1, sign=KEY.sign, public_key=PUB, created=manifest.created)
    assert resigned.encode() == OLD_MANIFEST  # a manifest with no header is still written as version 1


# ---- files that cannot come back as they are, refused at publish ----

def _raw_file(path, header: bytes, data: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


F32 = '{"dtype":"F32","shape":[1],"data_offsets":[%d,%d]}'
BAD_FILES = {
    "trailing bytes": (b'{"a":' + (F32 % (0, 4)).encode() + b"}", bytes(6), "hold 4 bytes but 6"),
    "a gap": (b'{"a":' + (F32 % (0, 4)).encode() + b',"b":' + (F32 % (8, 12)).encode() + b"}", bytes(12),
              "back to back"),
    "an overlap": (b'{"a":' + (F32 % (0, 4)).encode() + b',"b":' + (F32 % (0, 4)).encode() + b"}", bytes(8),
                   "back to back"),
    "short": (b'{"a":' + (F32 % (0, 4)).encode() + b"}", bytes(2), "hold 4 bytes but 2"),
    "a repeated key": (b'{"a":' + (F32 % (0, 4)).encode() + b',"a":' + (F32 % (0, 4)).encode() + b"}", bytes(4),
                       "repeated"),
    "an extra entry key": (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}}', bytes(4), "bad entry"),
    "metadata not strings": (b'{"__metadata__":{"step":1200}}', b"", "strings to strings"),
    "NaN": (b'{"__metadata__":{"a":NaN}}', b"", "not JSON"),
    "not UTF-8": (b'{"__metadata__":{"a":"\xff"}}', b"", "not JSON"),
    "an unknown dtype": (b'{"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}', bytes(1), "bad entry"),
    "a list": (b"[]", b"", "not a JSON object"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_files_that_could_not_come_back_faithfully_are_refused(tmp_path, case):
    header, data, message = BAD_FILES[case]
    path = tmp_path / "bad.safetensors"
    _raw_file(path, header, data)
    with pytest.raises(ValueError, match=message):
        encode_tensors(path)


def test_a_header_over_the_limit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(fmt, "MAX_HEADER", 64)
    path = tmp_path / "big.safetensors"
    _raw_file(path, b'{"__metadata__":{"a":"' + b"x" * 60 + b'"}}', b"")
    with pytest.raises(ValueError, match="at most 64"):
        encode_tensors(path)


# ---- file headers in manifests: peer data ----

@pytest.fixture(scope="module")
def signed(tmp_path_factory) -> tuple[list, dict]:
    """The body fields of a signed version-2 manifest (the "pretty" file), and its chunks by id."""
    path = tmp_path_factory.mktemp("signed") / "in.safetensors"
    hand_made(path, **HAND_MADE["pretty, metadata last"])
    layout, chunks = encode_tensors(path, chunk_size=64)
    manifest = sign_manifest(layout, "file", 1, sign=KEY.sign, public_key=PUB, created=1_700_000_000)
    return msgpack.unpackb(manifest.body(), raw=False), dict(zip((c.id for c in layout.chunks), chunks))


def _with_header(fields: list, header: object) -> bytes:
    return resign([*fields[:9], header])


def _entry(name: str, offsets: list[int], **change) -> dict:
    return {"dtype": TENSORS[name][0], "shape": TENSORS[name][1], "data_offsets": offsets, **change}


def _header(**change) -> bytes:
    """The tensors stored in name order, with ``change`` (name -> entry, or None to leave it out)."""
    header, at = {}, 0
    for name in NAMES:
        header[name] = _entry(name, [at, at + len(TENSORS[name][2])])
        at += len(TENSORS[name][2])
    header.update(change)
    return json.dumps({k: v for k, v in header.items() if v is not None}).encode()


BAD_HEADERS = {
    "empty": (b"", "1 to"),
    "text, not bytes": ("{}", "1 to"),
    "too long": (b" " * (fmt.MAX_HEADER + 1), "1 to"),
    "not JSON": (b"{", "not JSON"),
    "nested too deep": (b"[" * 100_000, "nests too deep|not JSON"),
    "a list": (b"[1]", "not a JSON object"),
    "huge number": (b'{"__metadata__":{},"w":{"dtype":"F32","shape":[1' + b"0" * 5000 + b'],"data_offsets":[0,4]}}',
                    "not JSON"),
    "a tensor missing": (_header(w=None), "does not describe|back to back"),
    "a tensor too many": (_header(x=_entry("n", [175, 183])), "does not describe"),
    "another dtype": (_header(b=_entry("b", [0, 32], dtype="I32")), "does not describe"),
    "another shape": (_header(b=_entry("b", [0, 32], shape=[2, 4])), "does not describe"),
    "offsets that overlap": (_header(m=_entry("m", [0, 3])), "back to back"),
    "offsets too long": (_header(m=_entry("m", [32, 36])), "bad entry"),
    "reversed offsets": (_header(m=_entry("m", [35, 32])), "bad entry"),
    "float offsets": (_header(m=_entry("m", [32.0, 35])), "bad entry"),
    "bool shape": (_header(m=_entry("m", [32, 35], shape=[True, True, True])), "bad entry"),
    "metadata a list": (_header(__metadata__=["a"]), "strings to strings"),
    "a repeated key": (b'{"__metadata__":{},"__metadata__":{}}', "repeated"),
    "a long name": (_header(**{"x" * 1025: _entry("e", [0, 0])}), "tensor name"),
}


@pytest.mark.parametrize("case", BAD_HEADERS)
def test_bad_file_headers_are_refused_even_when_signed(signed, case):
    header, message = BAD_HEADERS[case]
    with pytest.raises(ManifestError, match=message):
        decode_manifest(_with_header(signed[0], header))


def test_a_header_in_a_version_1_body_or_none_in_a_version_2_one_is_refused(signed):
    fields = signed[0]
    with pytest.raises(ManifestError, match="version-1 body has 9"):
        decode_manifest(resign([1, *fields[1:]]))
    with pytest.raises(ManifestError, match="version-2 body has 10"):
        decode_manifest(resign(fields[:9]))
    with pytest.raises(ManifestError, match="1 to"):
        decode_manifest(_with_header(fields, None))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=16)
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _decode_or_manifest_error(data: bytes, chunks: dict, tmp_path) -> None:
    """Decoding raises ManifestError or gives a manifest that re-encodes to ``data`` and whose
    file writes out with its header as it is."""
    try:
        manifest = decode_manifest(data)
    except ManifestError:
        return
    assert manifest.encode() == data
    out = tmp_path / "out.safetensors"
    write_safetensors(manifest, chunks, out)
    written = out.read_bytes()
    assert written[8:8 + len(manifest.header)] == manifest.header
    assert len(written) == 8 + len(manifest.header) + manifest.total_size


@FUZZ
@given(st.data(), json_values)
def test_mutated_header_fields_raise_only_manifest_error(signed, tmp_path, data, value):
    fields, chunks = signed
    header = json.loads(fields[9])
    key = data.draw(st.sampled_from([*header, "x"]))
    entry = header.get(key)
    if isinstance(entry, dict) and entry and data.draw(st.booleans()):
        entry[data.draw(st.sampled_from([*entry, "y"]))] = value  # one field of an entry, or a new one
        if isinstance(offsets := entry.get("data_offsets"), list) and offsets and data.draw(st.booleans()):
            offsets[data.draw(st.integers(0, len(offsets) - 1))] = data.draw(st.integers(-2, 200))
    else:
        header[key] = value  # a whole entry, the metadata, or a new key
    indent = data.draw(st.sampled_from([None, 0, 2]))
    raw = json.dumps(header, indent=indent, ensure_ascii=data.draw(st.booleans())).encode()
    _decode_or_manifest_error(_with_header(fields, raw + b" " * data.draw(st.integers(0, 9))), chunks, tmp_path)


@FUZZ
@given(st.data())
def test_mutated_header_bytes_raise_only_manifest_error(signed, tmp_path, data):
    fields, chunks = signed
    raw = bytearray(fields[9])
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    _decode_or_manifest_error(_with_header(fields, bytes(raw)), chunks, tmp_path)
    _decode_or_manifest_error(_with_header(fields, bytes(raw[:cut])), chunks, tmp_path)


@FUZZ
@given(json_values | st.binary(max_size=64))
def test_any_header_value_raises_only_manifest_error(signed, tmp_path, value):
    fields, chunks = signed
    _decode_or_manifest_error(_with_header(fields, value), chunks, tmp_path)
    if not isinstance(value, bytes):
        _decode_or_manifest_error(_with_header(fields, json.dumps(value).encode()), chunks, tmp_path)
