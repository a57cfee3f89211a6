"""A declared tensor set: a script's and its daemon's transfers take exactly the declared tensors."""

import pytest

from learn.encoded import Encoded
from learn.tensorset import SHADOW_ALIGN, SHADOW_HEADER, SetDecoder, check_specs, shadow_layout, wire_specs
from learn.wire import Limits, WireError, frames

SPECS = [["0.weight", "float32", [2, 3]], ["0.bias", "bfloat16", [3]], ["empty", "float32", [0]]]


def _raw(dtype: str, shape: tuple, fill: int) -> Encoded:
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    n = 1
    for d in shape:
        n *= d
    return Encoded("none", dtype, shape, 64, bytes([fill]) * (n * size))


def test_specs_read_back_as_written():
    specs = check_specs(SPECS)
    assert list(specs) == ["0.weight", "0.bias", "empty"] and specs["0.weight"] == ("float32", (2, 3))
    assert wire_specs(specs) == SPECS


@pytest.mark.parametrize("specs, words", [
    ([], "non-empty list"),
    ("x", "non-empty list"),
    ([["a", "float32"]], "[name, dtype, shape]"),
    ([["", "float32", [1]]], "1-256 characters"),
    ([["a" * 300, "float32", [1]]], "1-256 characters"),
    ([["a", "float32", [1]], ["a", "float32", [1]]], "named twice"),
    ([["a", "complex64", [1]]], "dtype 'complex64'"),
    ([["a", "float32", [-1]]], "non-negative"),
    ([["a", "float32", [1.5]]], "non-negative"),
    ([["a", "float32", [1] * 9]], "at most 8"),
    ([["a", "float32", [1 << 20, 1 << 20]]], "more than"),
])
def test_bad_specs_are_refused_by_name(specs, words):
    with pytest.raises(WireError, match=None) as info:
        check_specs(specs, Limits(max_bytes=1 << 30))
    assert words in str(info.value)


def test_only_floating_dtypes_when_asked():
    with pytest.raises(WireError, match="int64"):
        check_specs([["steps", "int64", []]], dtypes=("float32", "bfloat16"))


def test_a_transfer_lands_in_the_receivers_buffers():
    specs = check_specs(SPECS)
    buffers = {"0.weight": bytearray(24), "0.bias": bytearray(6)}
    decoder = SetDecoder(specs, 3, lambda name: memoryview(buffers[name]))
    sent = [("0.bias", _raw("bfloat16", (3,), 7)), ("empty", _raw("float32", (0,), 0)),
            ("0.weight", _raw("float32", (2, 3), 9))]
    for frame in frames(sent):
        assert not decoder.done
        decoder.feed(frame)
    assert decoder.done and decoder.names == ["0.bias", "empty", "0.weight"]
    assert buffers == {"0.weight": bytearray([9] * 24), "0.bias": bytearray([7] * 6)}
    with pytest.raises(WireError, match="more than the 3"):
        decoder.feed({"c": b"x"})


@pytest.mark.parametrize("name, enc, words", [
    ("other", _raw("float32", (2, 3), 1), "not one of the declared"),
    ("0.weight", _raw("float32", (3, 2), 1), "expected float32 of shape [2, 3], not 'float32' of shape [3, 2]"),
    ("0.weight", _raw("float32", (6,), 1), "shape [2, 3]"),
    ("0.bias", _raw("float16", (3,), 1), "expected bfloat16"),
    ("0.weight", _raw("float32", (4, 3), 1), "expected float32 of shape [2, 3]"),
    ("0.weight", Encoded("fp16", "float32", (2, 3), 64, b"\0" * 12), "uncompressed"),
    ("empty", Encoded("fp16", "float32", (0,), 64, b""), "uncompressed"),
])
def test_a_tensor_outside_the_declaration_is_refused_before_it_is_written(name, enc, words):
    buffers = {"0.weight": bytearray(24), "0.bias": bytearray(6)}
    decoder = SetDecoder(check_specs(SPECS), 1, lambda n: memoryview(buffers[n]))
    with pytest.raises(WireError) as info:
        for frame in frames([(name, enc)]):
            decoder.feed(frame)
    assert words in str(info.value)
    assert buffers["0.bias"] == bytearray(6)


def test_a_tensor_sent_twice_is_refused():
    buffers = {"0.weight": bytearray(24), "0.bias": bytearray(6)}
    decoder = SetDecoder(check_specs(SPECS), 2, lambda n: memoryview(buffers[n]))
    with pytest.raises(WireError, match="sent twice"):
        for frame in frames([("0.bias", _raw("bfloat16", (3,), 1))] * 2):
            decoder.feed(frame)


@pytest.mark.parametrize("count", [-1, 4, "2", True])
def test_a_transfer_holds_at_most_the_declared_tensors(count):
    with pytest.raises(WireError, match="0 to 3"):
        SetDecoder(check_specs(SPECS), count, lambda n: memoryview(bytearray()))


def test_a_shared_shadow_places_each_tensor_apart_and_aligned_after_the_header():
    specs = check_specs(SPECS + [["scalar", "float64", []], ["flag", "bool", [3]], ["last", "float16", [5]]])
    places, size = shadow_layout(specs)
    assert list(places) == list(specs)  # declared order
    assert places["0.weight"] == (SHADOW_HEADER, 24) and places["0.bias"] == (SHADOW_HEADER + 64, 6)
    assert places["empty"] == (SHADOW_HEADER + 128, 0) and places["scalar"] == (SHADOW_HEADER + 128, 8)
    spans = sorted(places.values())
    assert all(at % SHADOW_ALIGN == 0 for at, _ in spans)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # no overlap
    assert size == places["last"][0] + 64 and size >= places["last"][0] + places["last"][1]
    assert shadow_layout(check_specs([["e", "float32", [0]]])) == ({"e": (SHADOW_HEADER, 0)}, SHADOW_HEADER)
