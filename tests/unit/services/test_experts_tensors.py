"""The experts service's tensor decoder: peer data in, tensors or a clear InvalidArgument out, nothing else."""

import msgpack
import pytest
import torch
from hypothesis import given, settings, strategies as st

from meshd.rpc import InvalidArgument
from meshd.services.experts.tensors import from_wire, to_wire

LIMITS = {"max_tensors": 4, "max_bytes": 4096}
junk = st.recursive(st.none() | st.booleans() | st.integers(-3, 70) | st.text(max_size=8) | st.binary(max_size=40),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                        st.sampled_from(["dtype", "shape", "data", "x"]), inner, max_size=4), max_leaves=12)
maps = st.fixed_dictionaries({"dtype": st.sampled_from(["float32", "int64", "bool", "uint8", "complex", 3]),
                              "shape": st.lists(st.integers(-1, 5), max_size=9) | junk,
                              "data": st.binary(max_size=200) | junk})


@settings(max_examples=200, deadline=None)
@given(st.lists(maps, max_size=6) | junk)
def test_any_peer_data_decodes_or_is_an_invalid_argument(items):
    try:
        tensors = from_wire(items, **LIMITS)
    except InvalidArgument:
        return
    assert 0 < len(tensors) <= LIMITS["max_tensors"] and all(isinstance(t, torch.Tensor) for t in tensors)
    assert sum(t.numel() * t.element_size() for t in tensors) <= LIMITS["max_bytes"]


def wire(tensors) -> list:
    """What a peer receives: the maps through msgpack, as the RPC layer sends them."""
    return msgpack.unpackb(msgpack.packb(to_wire(tensors)))


def test_tensors_round_trip_and_the_limits_hold():
    tensors = [torch.randn(2, 3), torch.arange(5), torch.tensor([True, False])]
    back = from_wire(wire(tensors), **LIMITS)
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))
    with pytest.raises(InvalidArgument, match="1 to 4 tensors"):
        from_wire(wire([torch.zeros(1)] * 5), **LIMITS)
    with pytest.raises(InvalidArgument, match="more than 4096 bytes"):
        from_wire(wire([torch.zeros(600), torch.zeros(600)]), **LIMITS)
    with pytest.raises(InvalidArgument, match="bool"):
        from_wire([{"dtype": "bool", "shape": [1], "data": b"\x07"}], **LIMITS)
