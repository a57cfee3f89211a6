"""Codecs beyond the round trips of test_learn_codecs: empty and oddly shaped
tensors, the original dtype, malformed peer data, raw bytes of every dtype."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from learn.compress import CODECS, CodecError, ErrorFeedback, decode, encode
from learn.encoded import Encoded, payload_size
from learn.tensors import DTYPES, tensor_bytes, tensor_from_bytes, tensor_view


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("shape", [(0,), (3, 0), (1,), (2, 3, 5)])
def test_every_codec_round_trips_empty_and_multidimensional_tensors(codec, shape):
    tensor = torch.randn(shape)
    encoded = encode(tensor, codec)
    assert len(encoded.payload) == payload_size(codec, "float32", tensor.numel(), 64)
    back = decode(encoded)
    assert back.shape == tensor.shape and back.dtype == torch.float32
    assert torch.allclose(back, tensor, atol=0.3 * float(tensor.abs().max()) if tensor.numel() else 0)


@given(st.integers(1, 700), st.sampled_from([64, 256]))
@settings(max_examples=40, deadline=None)
def test_int4_keeps_the_sign_and_exact_multiples_of_its_step(numel, block):
    steps = torch.randint(-7, 8, (numel,)).float()
    steps[::block] = 7  # each block's absmax is 7 steps, so every value is exact
    tensor = steps * 0.25
    assert torch.equal(decode(encode(tensor, "int4", block)), tensor)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_casts_and_none_give_back_the_original_dtype_quantized_give_float32(dtype):
    tensor = torch.randn(100).to(dtype)
    assert decode(encode(tensor, "none")).dtype == dtype
    assert torch.equal(decode(encode(tensor, "none")), tensor)
    for codec in ("fp16", "bf16"):
        assert decode(encode(tensor, codec)).dtype == dtype
    for codec in ("int8", "int4"):
        assert decode(encode(tensor, codec)).dtype == torch.float32


def test_lossy_codecs_refuse_integer_tensors_both_ways():
    with pytest.raises(CodecError, match="floating"):
        encode(torch.arange(10), "int8")
    forged = Encoded("fp16", "int64", (10,), 64, bytes(20))
    with pytest.raises(CodecError, match="floating"):
        decode(forged)


@pytest.mark.parametrize("bad", [
    Encoded("int8", "float32", (-2, -2), 64, bytes(4 + 4)),
    Encoded("int8", "float32", (2.5,), 64, bytes(8)),
    Encoded("int8", "float32", (10,), 100, bytes(4 + 10)),
    Encoded("int4", "float32", (10,), 64, bytes(4 + 6)),
    Encoded("none", "complex64", (1,), 64, bytes(8)),
    Encoded("gzip", "float32", (1,), 64, bytes(4)),
])
def test_malformed_peer_data_is_a_codec_error_never_another_exception(bad):
    with pytest.raises(CodecError):
        decode(bad)


@given(st.binary(max_size=300), st.sampled_from(CODECS), st.integers(0, 80))
@settings(max_examples=100, deadline=None)
def test_random_payloads_decode_or_raise_codec_error(payload, codec, numel):
    encoded = Encoded(codec, "float32", (numel,), 64, payload)
    try:
        assert decode(encoded).shape == (numel,)
    except CodecError:
        assert len(payload) != payload_size(codec, "float32", numel, 64)


def test_error_feedback_keeps_the_tensors_dtype_and_forgets_on_reset():
    feedback = ErrorFeedback()
    tensor = torch.randn(300).to(torch.bfloat16)
    assert decode(feedback.compress("w", tensor, "fp16")).dtype == torch.bfloat16
    ramp = torch.linspace(-1, 1, 64)
    first = decode(feedback.compress("v", ramp, "int4"))
    assert not torch.equal(decode(feedback.compress("v", ramp, "int4")), first)
    feedback.reset()
    assert torch.equal(decode(feedback.compress("v", ramp, "int4")), first)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_raw_bytes_round_trip_every_wire_dtype_copied_if_read_only_shared_if_writable(dtype):
    tensor = (torch.randn(4, 6) * 50).to(DTYPES[dtype]).t()  # not contiguous
    data = tensor_bytes(tensor)
    assert len(data) == tensor.numel() * tensor.element_size()
    copied = tensor_from_bytes(memoryview(data).toreadonly(), dtype, tuple(tensor.shape))
    shared = tensor_from_bytes(data, dtype, tuple(tensor.shape))  # handed over: no copy
    viewed = tensor_from_bytes(memoryview(data), dtype, tuple(tensor.shape))  # a writable view: no copy either
    assert torch.equal(shared, tensor) and torch.equal(viewed, tensor)
    data[:] = bytes(len(data))
    assert torch.equal(copied, tensor)
    assert not shared.any() and not viewed.any()


@pytest.mark.parametrize("make", [lambda: torch.randn(3, 5), lambda: torch.randn(5, 3).t(), lambda: torch.zeros(0)],
                         ids=["contiguous", "strided", "empty"])
def test_tensor_view_is_the_tensor_bytes_read_only_and_shared_when_contiguous(make):
    tensor = make()
    view = tensor_view(tensor)
    assert view.readonly and bytes(view) == bytes(tensor_bytes(tensor))
    if tensor.is_contiguous() and tensor.numel():
        tensor.add_(1)  # a view, not a copy: it shows the change
        assert bytes(view) == bytes(tensor_bytes(tensor))
    del tensor
    assert len(bytes(view)) == len(view)  # the view keeps the memory alive


def test_a_writable_tensor_view_writes_into_the_tensor():
    tensor = torch.zeros(4)
    tensor_view(tensor, writable=True)[:4] = bytes(torch.tensor([1.5]).view(torch.uint8).tolist())
    assert tensor.tolist() == [1.5, 0, 0, 0]
    with pytest.raises(ValueError, match="contiguous"):
        tensor_view(torch.zeros(3, 2).t(), writable=True)


def test_none_encoding_shares_the_tensor_and_decodes_to_a_copy():
    tensor = torch.randn(100)
    encoded = encode(tensor, "none")
    back = decode(encoded)
    tensor.zero_()
    assert not any(bytes(encoded.payload)) and back.abs().sum() > 0


def test_raw_bytes_are_little_endian_row_major():
    assert bytes(tensor_bytes(torch.tensor([[1, 2], [3, 256]], dtype=torch.int16))) == \
        b"\x01\x00\x02\x00\x03\x00\x00\x01"
    with pytest.raises(ValueError, match="cannot hold"):
        tensor_from_bytes(b"\x00" * 7, "float32", (2,))
    with pytest.raises(ValueError, match="dtype"):
        tensor_from_bytes(b"", "complex64", (0,))


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "int4"])
def test_decoding_into_a_tensor_gives_the_same_values_in_it(codec):
    value = torch.randn(300, generator=torch.Generator().manual_seed(3))
    encoded = encode(value, codec, 64)
    into = torch.full((300,), 9.0)
    assert decode(encoded, into=into).data_ptr() == into.data_ptr()
    assert torch.equal(into, decode(encoded))


def test_decoding_into_a_tensor_that_does_not_fit_is_refused_and_leaves_it_alone():
    encoded = encode(torch.ones(64), "int8", 64)
    for into in (torch.zeros(63), torch.zeros(64, dtype=torch.float64), torch.zeros(128)[::2]):
        before = into.clone()
        with pytest.raises(ValueError):
            decode(encoded, into=into)
        assert torch.equal(into, before)
    with pytest.raises(ValueError):
        decode(encode(torch.ones(4), "none"), into=torch.zeros(4))  # codec none: nothing to decode into
