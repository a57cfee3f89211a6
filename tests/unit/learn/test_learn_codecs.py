"""Codecs and the wire: round trips, error bounds, error feedback, and refusals of bad frames."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from learn.compress import CODECS, CodecError, ErrorFeedback, decode, encode
from learn.encoded import Encoded, payload_size
from learn.wire import CHUNK, Contribution, Decoder, Limits, WireError, digest_of, frames


@given(st.integers(1, 3000), st.sampled_from(CODECS), st.sampled_from([64, 128, 1024]))
@settings(max_examples=60, deadline=None)
def test_every_codec_round_trips_within_its_error_bound(numel, codec, block):
    tensor = torch.randn(numel) * 5
    encoded = encode(tensor, codec, block)
    assert len(encoded.payload) == payload_size(codec, "float32", numel, block)
    back = decode(encoded)
    assert back.shape == tensor.shape
    if codec == "none":
        assert torch.equal(back, tensor)
    elif codec in ("int8", "int4"):
        levels = 127 if codec == "int8" else 7
        pad = (-numel) % block
        scales = torch.cat([tensor, tensor.new_zeros(pad)]).view(-1, block).abs().amax(1) / levels
        bound = scales.repeat_interleave(block)[:numel] / 2 + 1e-6
        assert bool(((back - tensor).abs() <= bound).all())
    else:
        assert torch.allclose(back, tensor, rtol=1e-2, atol=1e-2)


def test_error_feedback_carries_the_quantization_error_forward():
    tensor = torch.randn(4096)
    plain = sum(decode(encode(tensor, "int4")) for _ in range(50))
    feedback = ErrorFeedback()
    carried = sum(decode(feedback.compress("w", tensor, "int4")) for _ in range(50))
    exact = 50 * tensor
    assert (carried - exact).norm() < 0.05 * (plain - exact).norm()


def test_a_payload_of_the_wrong_size_or_codec_is_refused():
    good = encode(torch.randn(100), "int8")
    with pytest.raises(CodecError, match="not"):
        decode(Encoded("int8", "float32", (100,), 64, good.payload[:-1]))
    with pytest.raises(CodecError, match="unknown codec"):
        decode(Encoded("zip", "float32", (100,), 64, good.payload))
    with pytest.raises(CodecError, match="power of two"):
        encode(torch.randn(10), "int8", block=100)


tensor_sets = st.lists(
    st.tuples(st.text(min_size=1, max_size=20), st.lists(st.integers(0, 40), max_size=3),
              st.sampled_from(CODECS)),
    max_size=5, unique_by=lambda item: item[0])


@given(tensor_sets)
@settings(max_examples=40, deadline=None)
def test_any_tensor_set_survives_the_wire(spec):
    named = [(name, encode(torch.randn(tuple(shape)), codec)) for name, shape, codec in spec]
    decoder = Decoder()
    out = [item for frame in frames(named) for item in decoder.feed(frame)]
    decoder.finish()
    assert out == named
    assert digest_of(out) == digest_of(reversed(named))


def test_a_large_tensor_travels_in_bounded_chunks():
    named = [("w", encode(torch.randn(600_000)))]
    chunks = [f["c"] for f in frames(named) if "c" in f]
    assert len(chunks) == 3 and max(map(len, chunks)) == CHUNK


@given(st.integers(0, 40), st.binary(max_size=8))
@settings(max_examples=60, deadline=None)
def test_a_truncated_or_corrupted_stream_is_a_wire_error(cut, junk):
    stream = list(frames([("a", encode(torch.randn(50), "int8")), ("b", encode(torch.randn(7)))]))
    stream = stream[:cut % len(stream)] + [{"c": junk} if junk else {"x": 1}]
    decoder = Decoder()
    with pytest.raises(WireError):
        for frame in stream:
            decoder.feed(frame)
        decoder.finish()


def test_the_decoder_enforces_its_limits():
    named = [(f"t{i}", encode(torch.randn(10))) for i in range(3)]
    with pytest.raises(WireError, match="more than 2 tensors"):
        decoder = Decoder(Limits(max_tensors=2))
        for frame in frames(named):
            decoder.feed(frame)
    with pytest.raises(WireError, match="bytes of tensors"):
        decoder = Decoder(Limits(max_bytes=100))
        for frame in frames(named):
            decoder.feed(frame)
    with pytest.raises(WireError, match="sent twice"):
        decoder = Decoder()
        for frame in frames(named[:1] * 2):
            decoder.feed(frame)
    with pytest.raises(WireError, match="is 40 bytes, not 41"):
        Decoder().feed({"t": "w", "codec": "none", "dtype": "float32", "shape": [10], "block": 64, "bytes": 41})


def test_a_contribution_is_bound_to_its_signer_and_fields():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    key = Ed25519PrivateKey.generate()
    author = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def verify(public, signature, data):
        try:
            Ed25519PublicKey.from_public_bytes(public).verify(signature, data)
            return True
        except Exception:
            return False

    contribution = Contribution("run42", 3, author, "params", 128, bytes(32))
    signature = contribution.sign(key.sign)
    assert Contribution.from_wire(contribution.to_wire()).verify(signature, verify)
    forged = Contribution("run42", 4, author, "params", 128, bytes(32))
    assert not forged.verify(signature, verify)
    with pytest.raises(WireError):
        Contribution.from_wire({**contribution.to_wire(), "author": b"short"})
