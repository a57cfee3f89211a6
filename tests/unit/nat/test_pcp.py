"""PCP MAP (RFC 6887): requests on the wire, answers checked, version fallback, epochs."""

import struct

import pytest
from hypothesis import given, strategies as st

from nat import natpmp, pcp
from nat.errors import Malformed

NONCE = bytes(range(12))
REQUEST = pcp.MapRequest("10.1.0.2", 4100, external_port=4100, nonce=NONCE)


def answer(request=REQUEST, *, result=pcp.SUCCESS, lifetime=7200, epoch=100, address="198.51.100.10",
           port=4100, version=pcp.VERSION, options=b"") -> bytes:
    """A gateway's MAP answer to ``request``, as RFC 6887 section 11.1 lays it out."""
    mapped = b"\0" * 10 + b"\xff\xff" + bytes(int(x) for x in address.split("."))
    return struct.pack(">BBBBII12x", version, 0x80 | pcp.OP_MAP, 0, result, lifetime, epoch) + \
        struct.pack(">12sB3xHH16s", request.nonce, request.protocol, request.internal_port, port, mapped) + options


def test_a_map_request_is_60_bytes_laid_out_as_the_rfc_says():
    data = REQUEST.encode(7200)
    assert len(data) == 60
    assert data[:4] == bytes([2, 1, 0, 0]) and struct.unpack_from(">I", data, 4)[0] == 7200
    assert data[8:24] == b"\0" * 10 + b"\xff\xff" + bytes([10, 1, 0, 2])  # our address, IPv4-mapped
    assert data[24:36] == NONCE and data[36] == pcp.PROTOCOL_UDP
    assert struct.unpack_from(">HH", data, 40) == (4100, 4100)
    assert data[44:60] == b"\0" * 10 + b"\xff\xff" + b"\0" * 4  # no external address suggested
    assert struct.unpack_from(">I", REQUEST.encode(0), 4)[0] == 0  # lifetime 0 deletes


def test_each_request_gets_a_fresh_random_nonce_unless_given():
    a, b = pcp.MapRequest("10.1.0.2", 4100), pcp.MapRequest("10.1.0.2", 4100)
    assert len(a.nonce) == 12 and a.nonce != b.nonce


@pytest.mark.parametrize("kwargs, message", [
    ({"nonce": b"short"}, "nonce"), ({"internal_port": 0}, "all ports"), ({"internal_port": 70000}, "internal port"),
    ({"external_port": -1}, "external port"), ({"client_address": "gateway.local"}, "IPv4 or IPv6"),
])
def test_bad_requests_are_refused_when_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pcp.MapRequest(**{"client_address": "10.1.0.2", "internal_port": 4100, **kwargs})
    with pytest.raises(ValueError, match="lifetime"):
        REQUEST.encode(2**32)


def test_a_granted_mapping_is_read_back():
    granted = pcp.parse_map_response(answer(port=40000, lifetime=3600, epoch=7), REQUEST)
    assert granted == pcp.MapResult("198.51.100.10", 40000, 3600, 7)
    padded_option = bytes([130, 0, 0, 5]) + b"abcde" + b"\0\0\0"  # an optional option, padded to 4
    assert pcp.parse_map_response(answer(options=padded_option), REQUEST).external_port == 4100


def test_refusals_carry_the_result_code_and_its_lifetime():
    with pytest.raises(pcp.PcpError, match="not authorized") as refused:
        pcp.parse_map_response(answer(result=2, lifetime=30), REQUEST)
    assert (refused.value.result, refused.value.lifetime) == (2, 30)
    header_only = answer(result=8)[:24]  # an error may come without the opcode's data
    with pytest.raises(pcp.PcpError, match="no resources"):
        pcp.parse_map_response(header_only, REQUEST)


def test_a_natpmp_gateway_or_an_older_pcp_means_fall_back():
    natpmp_says = natpmp.unsupported_version_response(5, 1)
    assert natpmp_says[:4] == bytes([0, 129, 0, 1]) and len(natpmp_says) == 8
    with pytest.raises(pcp.UnsupportedVersion) as fallback:
        pcp.parse_map_response(natpmp_says, REQUEST)
    assert fallback.value.version == 0
    with pytest.raises(pcp.UnsupportedVersion) as older:
        pcp.parse_map_response(answer(version=1, result=pcp.UNSUPP_VERSION)[:24], REQUEST)
    assert older.value.version == 1


@pytest.mark.parametrize("data, why", [
    (answer()[:20], "bytes"),  # shorter than a header
    (answer() + b"\0\0", "multiple of 4"),
    (answer() + b"\0" * 1100, "1100"),
    (REQUEST.encode(60), "not an answer"),  # our own request echoed (R bit clear)
    (answer()[:24] + b"\0" * 12, "no room"),  # success without the MAP data
    (answer(pcp.MapRequest("10.1.0.2", 4100, nonce=b"x" * 12)), "another mapping"),  # another nonce
    (answer(pcp.MapRequest("10.1.0.2", 4101, nonce=NONCE)), "another mapping"),  # another port
    (answer(version=3), "version 3"),
    (answer(options=bytes([1, 0, 0, 40]) + b"\0" * 4), "past the end"),
    (answer(options=b"\0\0"), "multiple of 4"),
    (answer(port=0), "without an external"),
    (answer(address="0.0.0.0"), "without an external"),
    (natpmp.external_address_response(1, "198.51.100.10"), "not 'unsupported version'"),
])
def test_datagrams_that_are_not_our_answer_are_malformed_and_ignored(data, why):
    with pytest.raises(Malformed, match=why):
        pcp.parse_map_response(data, REQUEST)


def test_a_deleted_mapping_may_come_back_without_an_address():
    deleted = pcp.parse_map_response(answer(lifetime=0, port=0, address="0.0.0.0"), REQUEST)
    assert deleted.lifetime == 0


@given(st.binary(max_size=200))
def test_garbage_raises_only_pcp_errors(data):
    try:
        pcp.parse_map_response(data, REQUEST)
    except (Malformed, pcp.PcpError):
        pass


@given(st.binary(min_size=60, max_size=60))
def test_garbage_with_our_header_and_nonce_raises_only_pcp_errors(tail):
    data = bytes([2, 0x81, 0]) + tail[3:24] + NONCE + tail[36:]
    try:
        pcp.parse_map_response(data, REQUEST)
    except (Malformed, pcp.PcpError):
        pass


def test_epochs_reveal_a_gateway_that_lost_its_state():
    epoch = pcp.Epoch()
    assert not epoch.lost_state(1000, now=50.0)  # the first answer sets the baseline
    assert not epoch.lost_state(1100, now=150.0)  # both clocks moved alike
    assert not epoch.lost_state(1102, now=151.0)  # within the RFC's tolerance
    assert epoch.lost_state(5, now=160.0)  # the epoch went back: a restart
    assert not epoch.lost_state(15, now=170.0)
    assert epoch.lost_state(20, now=570.0)  # 400 s passed for us, 5 s for the gateway
    assert not epoch.lost_state(420, now=970.0)
    assert epoch.lost_state(2000, now=980.0)  # the gateway's clock ran far ahead
