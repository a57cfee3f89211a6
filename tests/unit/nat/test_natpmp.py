"""NAT-PMP messages (RFC 6886): both directions, and refusals and garbage."""

import pytest
from hypothesis import given, strategies as st

from nat import natpmp


@given(st.integers(0, 65535), st.integers(0, 65535), st.integers(0, 2**32 - 1))
def test_map_requests_and_answers_round_trip(internal, external, lifetime):
    opcode, asked = natpmp.parse_request(natpmp.map_udp_request(internal, external, lifetime))
    assert opcode == natpmp.OP_MAP_UDP and asked == natpmp.Mapping(internal, external, lifetime)
    granted = natpmp.Mapping(internal, external, lifetime, epoch=77)
    assert natpmp.parse_map_udp(natpmp.map_udp_response(77, granted)) == granted


def test_external_address_round_trip_and_wire_sizes():
    assert natpmp.parse_request(natpmp.external_address_request()) == (natpmp.OP_EXTERNAL_ADDRESS, None)
    answer = natpmp.external_address_response(5, "203.0.113.9")
    assert len(answer) == 12 and natpmp.parse_external_address(answer) == "203.0.113.9"
    assert len(natpmp.map_udp_request(4100, 4100, 7200)) == 12


def test_refusals_and_malformed_answers_say_what_happened():
    refused = natpmp.map_udp_response(1, natpmp.Mapping(1, 1, 0), result=natpmp.REFUSED)
    with pytest.raises(natpmp.NatPmpError, match="not authorized or refused"):
        natpmp.parse_map_udp(refused)
    with pytest.raises(natpmp.NatPmpError, match="too short"):
        natpmp.parse_map_udp(b"\x00")
    with pytest.raises(natpmp.NatPmpError, match="not an answer to opcode 1"):
        natpmp.parse_map_udp(natpmp.external_address_response(1, "203.0.113.9"))
    with pytest.raises(natpmp.NatPmpError, match="expected 16"):
        natpmp.parse_map_udp(natpmp.map_udp_response(1, natpmp.Mapping(1, 1, 0)) + b"x")
    with pytest.raises(natpmp.NatPmpError):
        natpmp.parse_request(b"\x01\x00")
    with pytest.raises(ValueError, match="lifetime"):
        natpmp.map_udp_request(1, 1, -1)


@given(st.binary(max_size=40))
def test_garbage_raises_only_natpmp_errors(data):
    for parse in (natpmp.parse_map_udp, natpmp.parse_external_address, natpmp.parse_request):
        try:
            parse(data)
        except natpmp.NatPmpError:
            pass
