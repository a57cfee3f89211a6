"""A lossy codec's part: the vector keeps what the others receive, the error buffer what was lost."""

from __future__ import annotations

import torch

from learn.compress import decode, encode
from meshd.services.learning.group import Group


def test_a_lossy_part_becomes_its_decoding_and_the_loss_goes_to_the_error_buffer():
    original = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    part, error = original.clone(), torch.full((1000,), 5.0)
    encoded = Group._encode_part(part, lambda t: encode(t, "int8", 64), decode, error)
    received = decode(encoded)
    assert torch.equal(part, received)  # what every member reduces with
    assert torch.equal(error, original - received) and error.abs().max() > 0


def test_a_lossless_part_is_sent_as_it_is_and_loses_nothing():
    original = torch.randn(100, generator=torch.Generator().manual_seed(1))
    part, error = original.clone(), torch.full((100,), 5.0)
    encoded = Group._encode_part(part, lambda t: encode(t, "none"), decode, error)
    assert torch.equal(part, original) and torch.equal(decode(encoded), original)
    assert not error.any()


def test_a_lossy_reduced_slice_is_decoded_into_its_place_when_it_fits():
    from meshd.services.learning.group import _decode_into

    value = torch.randn(256, generator=torch.Generator().manual_seed(2))
    encoded = encode(value, "int8", 64)
    place = torch.zeros(256)
    got = _decode_into(decode, encoded, place)
    assert got.data_ptr() == place.data_ptr() and torch.equal(place, decode(encoded))
    other = torch.zeros(100)  # a slice of another size: decoded on its own, the place untouched
    got = _decode_into(decode, encoded, other)
    assert got.data_ptr() != other.data_ptr() and torch.equal(got, decode(encoded)) and not other.any()
