"""learn.wire: tensor sets as bounded frames, decoded with limits; signed contributions."""

import dataclasses
import random

import msgpack
import pytest
import torch
from hypothesis import given, settings, strategies as st

from learn.compress import decode, encode
from learn.encoded import Encoded, payload_size
from learn.wire import (
    CHUNK, Contribution, Decoder, Limits, WireError, chunk_counts, chunk_ids, digest_of, frames, header, lent_chunks,
    roster_digest, subset_bits, subset_of,
)

FLOATS = ["float32", "float16", "bfloat16", "float64"]


def _encoded(draw_codec: str, dtype: str, shape: tuple, block: int, seed: int) -> Encoded:
    """An Encoded with a payload of the exact size (random bytes: the wire does not read payloads)."""
    size = payload_size(draw_codec, dtype, torch.Size(shape).numel(), block)
    return Encoded(draw_codec, dtype, shape, block, random.Random(seed).randbytes(size))


@st.composite
def tensor_sets(draw, max_tensors=5):
    names = draw(st.lists(st.text(min_size=1, max_size=20), max_size=max_tensors, unique=True))
    named = []
    for i, name in enumerate(names):
        codec = draw(st.sampled_from(["none", "fp16", "bf16", "int8", "int4"]))
        dtype = draw(st.sampled_from(FLOATS if codec != "none" else
                                     FLOATS + ["int64", "int32", "uint8", "bool"]))
        shape = tuple(draw(st.lists(st.integers(0, 30), max_size=3)))
        named.append((name, _encoded(codec, dtype, shape, draw(st.sampled_from([64, 256, 1024])), i)))
    return named


def _decode_all(stream, limits=Limits()):
    decoder = Decoder(limits)
    out = [item for frame in stream for item in decoder.feed(frame)]
    decoder.finish()
    return out


@given(tensor_sets())
@settings(max_examples=60, deadline=None)
def test_any_tensor_set_survives_the_wire_through_msgpack(named):
    stream = [msgpack.unpackb(msgpack.packb(frame)) for frame in frames(named)]
    assert _decode_all(stream) == named


def test_real_tensors_survive_the_wire_with_their_codecs():
    named = [("b", encode(torch.randn(3, 5), "int4", 64)), ("a", encode(torch.arange(7), "none", 64))]
    out = _decode_all(frames(named))
    assert [name for name, _ in out] == ["b", "a"]
    assert torch.equal(decode(out[1][1]), torch.arange(7))
    assert torch.equal(decode(out[0][1]), decode(named[0][1]))


def test_a_large_payload_travels_in_chunks_of_at_most_one_mib():
    named = [("w", _encoded("none", "float32", (600_000,), 64, 0))]
    stream = list(frames(named))
    assert stream[0] == {"t": "w", "codec": "none", "dtype": "float32", "shape": [600_000], "block": 64,
                         "bytes": 2_400_000}
    assert [len(f["c"]) for f in stream[1:]] == [CHUNK, CHUNK, 2_400_000 - 2 * CHUNK]
    assert _decode_all(stream) == named


def test_the_decoder_returns_each_tensor_when_its_last_chunk_arrives():
    named = [("a", _encoded("none", "float32", (3,), 64, 1)), ("empty", _encoded("none", "int64", (0, 4), 64, 2))]
    decoder = Decoder()
    head, chunk, empty_head = frames(named)
    assert decoder.feed(head) == []
    assert decoder.feed(chunk) == [named[0]]
    assert decoder.feed(empty_head) == [named[1]]  # no payload, complete at once
    decoder.finish()


@pytest.mark.parametrize("field, junk", [("dtype", []), ("dtype", {}), ("codec", []), ("shape", {})])
def test_an_unhashable_field_in_a_tensor_head_is_a_wire_error(field, junk):
    [head, *rest] = frames([("0", Encoded("none", "float32", (), 64, bytes(4)))])
    with pytest.raises(WireError):
        _decode_all([{**head, field: junk}, *rest])


@given(tensor_sets(), st.data())
@settings(max_examples=100, deadline=None)
def test_a_truncated_or_corrupted_stream_is_a_wire_error_and_nothing_else(named, data):
    stream = [msgpack.unpackb(msgpack.packb(frame)) for frame in frames(named)]
    junk = st.one_of(st.none(), st.integers(), st.floats(), st.binary(max_size=9), st.text(max_size=5),
                     st.lists(st.integers(-2, 2), max_size=3), st.dictionaries(st.text(max_size=2), st.none()))
    how = data.draw(st.sampled_from(["cut", "drop", "field", "insert"]))
    if how == "cut":
        stream = stream[:data.draw(st.integers(0, max(0, len(stream) - 1)))]
    elif how == "drop" and stream:
        stream.pop(data.draw(st.integers(0, len(stream) - 1)))
    elif how == "field" and stream:
        at = data.draw(st.integers(0, len(stream) - 1))
        key = data.draw(st.sampled_from(sorted(stream[at])))
        stream[at] = {**stream[at], key: data.draw(junk)}
    else:
        frame = data.draw(st.one_of(junk, st.dictionaries(st.sampled_from(["t", "c", "x"]), junk, max_size=2)))
        stream.insert(data.draw(st.integers(0, len(stream))), frame)
    try:
        out = _decode_all(stream)
    except WireError:
        return  # any other exception fails the test
    # What decodes is well formed: a cut at a tensor's end leaves the tensors before it (the
    # signed digest catches that), and junk can happen to be valid (a chunk of the right size).
    assert len({name for name, _ in out}) == len(out)
    for name, enc in out:
        assert len(enc.payload) == payload_size(enc.codec, enc.dtype, enc.numel, enc.block)
    if how == "cut":
        assert out == named[:len(out)]


def _one(codec="none", dtype="float32", shape=(10,), block=64, size=40, name="w", **extra):
    """One tensor's frames, ten float32 values' worth of payload, with a header field changed."""
    head = {"t": name, "codec": codec, "dtype": dtype, "shape": list(shape), "block": block, "bytes": size, **extra}
    return [head, {"c": bytes(40)}]


@pytest.mark.parametrize("stream, message", [
    (_one(codec="zip"), "unknown codec"),
    (_one(dtype="complex64"), "dtype"),
    (_one(codec="int8", dtype="int32"), "floating"),
    (_one(codec="int8", block=100), "power of two"),
    (_one(size=41), "is 40 bytes, not 41"),
    (_one(shape=(2, -1)), "non-negative"),
    (_one(shape=(1,) * 9), "at most 8"),
    (_one(name=""), "name"),
    (_one(name="x" * 257), "name"),
    (_one(extra=1), "fields"),
    ([{"c": b"1234"}], "without a tensor header"),
    ([{"t": "w"}], "fields"),
    ([7], "a frame is a map"),
    (_one() + [{"c": b"1"}], "without a tensor header"),
    (_one()[:1] + [{"c": b""}], "empty"),
    (_one()[:1] + [{"c": bytes(41)}], "more bytes than announced"),
    (_one()[:1] + _one(), "ended early"),
    (_one()[:1], "ended early"),
    (_one() + _one(), "sent twice"),
])
def test_each_malformed_stream_is_refused_with_a_clear_message(stream, message):
    with pytest.raises(WireError, match=message):
        _decode_all(stream)


def test_the_decoder_enforces_its_limits():
    named = [(f"t{i}", _encoded("none", "float32", (10,), 64, i)) for i in range(3)]
    with pytest.raises(WireError, match="more than 2 tensors"):
        _decode_all(frames(named), Limits(max_tensors=2))
    with pytest.raises(WireError, match="more than 100 bytes"):
        _decode_all(frames(named), Limits(max_bytes=100))
    with pytest.raises(WireError, match="name"):
        _decode_all(frames(named), Limits(max_name=1))
    assert _decode_all(frames(named), Limits(max_tensors=3, max_bytes=120, max_name=2)) == named


def test_the_digest_covers_every_field_and_not_the_order():
    named = [("a", _encoded("int8", "float32", (100,), 64, 1)), ("b", _encoded("none", "int64", (2,), 64, 2))]
    digest = digest_of(named)
    assert len(digest) == 32 and digest_of(reversed(named)) == digest
    a = named[0][1]
    changed = [
        Encoded("int8", "float32", (100,), 64, bytes([a.payload[0] ^ 1]) + a.payload[1:]),
        Encoded("int8", "float16", (100,), 64, a.payload),
        Encoded("int8", "float32", (10, 10), 64, a.payload),
    ]
    for other in changed:
        assert digest_of([("a", other), named[1]]) != digest
    assert digest_of([("c", a), named[1]]) != digest
    assert digest_of(named[:1]) != digest


def test_the_digest_does_not_depend_on_how_many_threads_hash():
    big = Encoded("none", "uint8", (3 << 20,), 64, bytes(range(256)) * (3 << 12))  # blake3 splits it
    named = [("big", big), ("small", _encoded("none", "int64", (2,), 64, 2))]
    assert digest_of(named, threads=1) == digest_of(named, threads=4) == digest_of(named)


class _Keys:
    """Toy signatures for the injected sign/verify: blake3-keyed, enough to test the binding."""

    def __init__(self, seed):
        self.public = random.Random(seed).randbytes(32)

    def sign(self, data: bytes) -> bytes:
        import blake3
        return blake3.blake3(data, key=self.public).digest()

    @staticmethod
    def verify(public: bytes, signature: bytes, data: bytes) -> bool:
        import blake3
        return blake3.blake3(data, key=public).digest() == signature


def _contribution(author: bytes, **changes) -> Contribution:
    fields = {"group": "run42", "round": 3, "author": author, "kind": "delta", "samples": 128,
              "digest": digest_of([("w", _encoded("none", "float32", (4,), 64, 0))])}
    return Contribution(**{**fields, **changes})


def test_a_contribution_is_bound_to_its_author_and_every_field():
    keys = _Keys(1)
    contribution = _contribution(keys.public)
    signature = contribution.sign(keys.sign)
    assert contribution.signed_bytes().startswith(b"meshd-learn-v1")
    assert Contribution.from_wire(msgpack.unpackb(msgpack.packb(contribution.to_wire()))) == contribution
    assert contribution.verify(signature, keys.verify)
    for change in [{"group": "run43"}, {"round": 4}, {"kind": "params"}, {"samples": 129},
                   {"digest": bytes(32)}, {"author": _Keys(2).public}]:
        assert not dataclasses.replace(contribution, **change).verify(signature, keys.verify), change
    assert not contribution.verify("not bytes", keys.verify)


@pytest.mark.parametrize("change", [
    {"group": ""}, {"group": "g" * 257}, {"group": 5}, {"round": -1}, {"round": True}, {"round": 1.0},
    {"author": b"short"}, {"author": "x" * 32}, {"kind": ""}, {"kind": "k" * 65}, {"samples": -1},
    {"samples": None}, {"digest": bytes(31)}, {"extra": 1},
])
def test_a_malformed_contribution_is_a_wire_error(change):
    wire = {**_contribution(bytes(32)).to_wire(), **change}
    with pytest.raises(WireError):
        Contribution.from_wire(wire)


def test_a_contribution_with_a_missing_field_or_not_a_map_is_a_wire_error():
    wire = _contribution(bytes(32)).to_wire()
    for key in wire:
        with pytest.raises(WireError, match=f"missing: {key}"):
            Contribution.from_wire({k: v for k, v in wire.items() if k != key})
    with pytest.raises(WireError, match="map"):
        Contribution.from_wire([1, 2])


@settings(max_examples=60, deadline=None)
@given(tensor_sets())
def test_headers_with_lent_chunks_rebuild_the_same_set_as_frames(named):
    heads = [header(name, enc) for name, enc in named]
    lent = lent_chunks(named)
    counts = chunk_counts(heads, Limits())
    assert sum(counts) == len(lent) and all(len(c) <= CHUNK for c in lent)
    stream, at = [], 0
    for head, count in zip(heads, counts):
        stream += [head] + [{"c": bytes(c)} for c in lent[at:at + count]]
        at += count
    assert stream == list(frames(named))
    assert _decode_all(stream) == [(n, dataclasses.replace(e, payload=bytes(e.payload))) for n, e in named]


def test_lent_chunks_are_views_and_their_ids_are_the_tickets():
    payload = bytearray(random.Random(1).randbytes(CHUNK + 5))
    lent = lent_chunks([("w", Encoded("none", "uint8", (len(payload),), 64, payload))])
    assert [len(c) for c in lent] == [CHUNK, 5]
    payload[0] ^= 1
    assert lent[0][0] == payload[0]  # no copy
    ids = chunk_ids(b"t" * 32, 3)
    assert len(set(ids)) == 3 and all(len(i) == 32 for i in ids)
    assert ids[:2] == chunk_ids(b"t" * 32, 2) and not set(ids) & set(chunk_ids(b"u" * 32, 3))


@pytest.mark.parametrize("heads, message", [
    ([{"c": b"x"}], "header"),
    ([{"t": "w", "bytes": "9"}], "size"),
    ([{"t": "w", "bytes": -1}], "size"),
    ([{"t": "w", "bytes": 1 << 20}] * 3, "more than"),
    ([{"t": str(i), "bytes": 0} for i in range(4)], "more than 3 tensors"),
])
def test_chunk_counts_refuse_what_is_not_a_header_or_over_the_limits(heads, message):
    with pytest.raises(WireError, match=message):
        chunk_counts(heads, Limits(max_tensors=3, max_bytes=(2 << 20) + 1))


def test_a_decoder_fills_the_buffers_into_gives_and_copies_borrowed_chunks_otherwise():
    payload = random.Random(2).randbytes(CHUNK + 10)
    named = [("a", Encoded("none", "uint8", (len(payload),), 64, payload)), ("b", Encoded("none", "uint8", (3,), 64, b"xyz"))]
    own = bytearray(len(payload))
    decoder = Decoder(into=lambda name, codec, n: memoryview(own) if name == "a" else None)
    reused = bytearray(CHUNK)  # a source that reuses one buffer for every chunk, as meshd's lane does
    out = []
    for frame in frames(named):
        if "c" in frame:
            reused[:len(frame["c"])] = frame["c"]
            frame = {"c": memoryview(reused)[:len(frame["c"])]}
        out += decoder.feed(frame)
    assert [bytes(e.payload) for _, e in out] == [payload, b"xyz"]
    assert out[0][1].payload.obj is own  # filled in place
    with pytest.raises(ValueError, match="writable"):
        Decoder(into=lambda *_: memoryview(b"abc")).feed(frames(named[1:]).__next__())


@given(tensor_sets())
@settings(max_examples=60, deadline=None)
def test_what_a_decoder_decodes_has_the_digest_of_what_was_sent_in_any_order(named):
    """A receiver that must check a copy passed on by someone else takes digest_of what it decoded."""
    decoder = Decoder()
    out = [item for frame in frames(named) for item in decoder.feed(frame)]
    assert [(name, bytes(enc.payload)) for name, enc in out] == [(name, bytes(enc.payload)) for name, enc in named]
    assert digest_of(out) == digest_of(named)


class _Collect:
    def __init__(self):
        self.writes = []

    def write(self, at, chunk):
        self.writes.append((at, bytes(chunk)))


def test_a_sink_takes_each_chunk_in_order_and_nothing_keeps_the_payload():
    payload = random.Random(3).randbytes(2 * CHUNK + 5)
    named = [("a", Encoded("none", "uint8", (len(payload),), 64, payload)), ("b", Encoded("none", "uint8", (3,), 64, b"xyz"))]
    sink = _Collect()
    decoder = Decoder(into=lambda name, codec, n: sink if name == "a" else None)
    out = [item for frame in frames(named) for item in decoder.feed(frame)]
    assert [at for at, _ in sink.writes] == [0, CHUNK, 2 * CHUNK]
    assert b"".join(chunk for _, chunk in sink.writes) == payload
    assert out[0][1].payload is sink and bytes(out[1][1].payload) == b"xyz"


KEYS = [bytes([i]) * 32 for i in range(1, 20)]


def test_a_roster_digest_names_the_list_in_its_order_and_nothing_else():
    assert len(roster_digest(KEYS)) == 32
    assert roster_digest(KEYS) == roster_digest(list(KEYS))
    assert roster_digest(KEYS) != roster_digest(KEYS[:-1])
    assert roster_digest(KEYS) != roster_digest(KEYS[::-1])
    assert roster_digest([b"a" * 32, b"b" * 32]) != roster_digest([b"a" * 31, b"ab" + b"b" * 30])


@given(st.sets(st.integers(0, len(KEYS) - 1)))
def test_a_subset_of_a_roster_goes_into_one_bit_a_member_and_back(chosen):
    subset = [KEYS[i] for i in sorted(chosen)]
    bits = subset_bits(KEYS, subset)
    assert len(bits) == (len(KEYS) + 7) // 8  # 19 members: 3 bytes, not 19 x 34
    assert subset_of(KEYS, bits) == subset


@pytest.mark.parametrize("bits", [b"", b"\xff\xff", b"\xff\xff\xff\xff", b"\x00\x00\x08", "abc", None])
def test_a_bitmap_of_another_length_or_with_bits_past_the_roster_is_refused(bits):
    with pytest.raises(ValueError):
        subset_of(KEYS, bits)  # 19 members: 3 bytes whose last 5 bits are 0


def test_a_subset_naming_a_key_off_the_roster_cannot_be_put_in_bits():
    with pytest.raises(ValueError):
        subset_bits(KEYS, [b"z" * 32])
