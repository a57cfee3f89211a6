"""nat.stun (codec) and nat.transaction (client retransmissions): vectors, malformed input, properties."""

import hashlib
import hmac
import ipaddress
import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nat import (
    BINDING,
    CHANGE_REQUEST,
    ERROR_CODE,
    FINGERPRINT,
    ICE_CONTROLLED,
    MAGIC_COOKIE,
    MAPPED_ADDRESS,
    MAX_MESSAGE_SIZE,
    MESSAGE_INTEGRITY,
    MESSAGE_INTEGRITY_SHA256,
    PRIORITY,
    SOFTWARE,
    UNKNOWN_ATTRIBUTES,
    USERNAME,
    XOR_MAPPED_ADDRESS,
    ClientTransaction,
    IntegrityError,
    StunClass,
    StunError,
    StunMessage,
    TransactionTimeout,
    UnknownAttributesError,
    address_value,
    binding_request,
    binding_success,
    decode,
    error_code_value,
    error_response,
    is_stun,
    parse_header,
    saslprep,
    short_term_key,
    xor_address_value,
)

# ------------------------------------------------------------- RFC 5769 vectors

PASSWORD = "VOkJxbRl1RmTxUk/WvJxBt"
KEY = short_term_key(PASSWORD)
TID = bytes.fromhex("b7e7a701bc34d686fa87dfae")

# 2.1: Binding request with SOFTWARE, PRIORITY, ICE-CONTROLLED, USERNAME, MESSAGE-INTEGRITY, FINGERPRINT.
SAMPLE_REQUEST = bytes.fromhex(
    "000100582112a442b7e7a701bc34d686fa87dfae"
    "802200105354554e207465737420636c69656e74"
    "002400046e0001ff"
    "80290008932ff9b151263b36"
    "000600096576746a3a68367659202020"
    "000800149aeaa70cbfd8cb56781ef2b5b2d3f249c1b571a2"
    "80280004e57a3bcf"
)
# 2.2: success response, XOR-MAPPED-ADDRESS 192.0.2.1:32853.
SAMPLE_IPV4_RESPONSE = bytes.fromhex(
    "0101003c2112a442b7e7a701bc34d686fa87dfae"
    "8022000b7465737420766563746f7220"
    "002000080001a147e112a643"
    "000800142b91f599fd9e90c38c7489f92af9ba53f06be7d7"
    "80280004c07d4c96"
)
# 2.3: success response, XOR-MAPPED-ADDRESS [2001:db8:1234:5678:11:2233:4455:6677]:32853.
SAMPLE_IPV6_RESPONSE = bytes.fromhex(
    "010100482112a442b7e7a701bc34d686fa87dfae"
    "8022000b7465737420766563746f7220"
    "002000140002a1470113a9faa5d3f179bc25f4b5bed2b9d9"
    "00080014a382954e4be67bf11784c97c8292c275bfe3ed41"
    "80280004c8fb0b4c"
)


def test_rfc5769_sample_request_decodes_and_reencodes_byte_exact():
    message = decode(SAMPLE_REQUEST, integrity_key=KEY)
    assert (message.method, message.cls, message.transaction_id) == (BINDING, StunClass.REQUEST, TID)
    assert message.attributes == (
        (SOFTWARE, b"STUN test client"),
        (PRIORITY, bytes.fromhex("6e0001ff")),
        (ICE_CONTROLLED, bytes.fromhex("932ff9b151263b36")),
        (USERNAME, b"evtj:h6vY"),
    )
    assert message.software == "STUN test client"
    assert message.username == "evtj:h6vY"
    # The vector pads USERNAME with spaces, which MESSAGE-INTEGRITY covers.
    assert message.encode(integrity_key=KEY, pad_byte=0x20) == SAMPLE_REQUEST


@pytest.mark.parametrize(
    "datagram, address",
    [
        (SAMPLE_IPV4_RESPONSE, ("192.0.2.1", 32853)),
        (SAMPLE_IPV6_RESPONSE, ("2001:db8:1234:5678:11:2233:4455:6677", 32853)),
    ],
)
def test_rfc5769_sample_responses_decode_and_reencode_byte_exact(datagram, address):
    message = decode(datagram, integrity_key=KEY)
    assert (message.method, message.cls, message.transaction_id) == (BINDING, StunClass.SUCCESS, TID)
    assert message.xor_mapped_address == address
    assert message.software == "test vector"
    assert message.encode(integrity_key=KEY, pad_byte=0x20) == datagram
    rebuilt = StunMessage(
        BINDING,
        StunClass.SUCCESS,
        TID,
        ((SOFTWARE, b"test vector"), (XOR_MAPPED_ADDRESS, xor_address_value(address, TID))),
    )
    assert rebuilt.encode(integrity_key=KEY, pad_byte=0x20) == datagram


def test_rfc5769_vectors_decode_without_a_key_and_fail_with_a_wrong_one():
    assert decode(SAMPLE_REQUEST).username == "evtj:h6vY"
    with pytest.raises(IntegrityError, match="MESSAGE-INTEGRITY does not match") as caught:
        decode(SAMPLE_REQUEST, integrity_key=short_term_key("wrong"))
    assert caught.value.code == 401
    assert caught.value.parsed.transaction_id == TID


def test_every_single_byte_change_to_a_sample_is_refused_or_ignored():
    original = decode(SAMPLE_REQUEST, integrity_key=KEY)
    fingerprint_type = range(len(SAMPLE_REQUEST) - 8, len(SAMPLE_REQUEST) - 6)
    for i in range(len(SAMPLE_REQUEST)):
        for flip in (0x01, 0x80):
            damaged = bytearray(SAMPLE_REQUEST)
            damaged[i] ^= flip
            if i in fingerprint_type:
                # No longer a FINGERPRINT but an attribute after MESSAGE-INTEGRITY: ignored.
                assert decode(bytes(damaged), integrity_key=KEY) == original
                continue
            with pytest.raises(StunError):
                decode(bytes(damaged), integrity_key=KEY)


# ------------------------------------------------------------- building and encoding


def test_message_type_interleaves_method_and_class_bits():
    tid = bytes(12)
    assert StunMessage(BINDING, StunClass.REQUEST, tid).encode(fingerprint=False)[:2] == b"\x00\x01"
    assert StunMessage(BINDING, StunClass.INDICATION, tid).encode(fingerprint=False)[:2] == b"\x00\x11"
    assert StunMessage(BINDING, StunClass.SUCCESS, tid).encode(fingerprint=False)[:2] == b"\x01\x01"
    assert StunMessage(BINDING, StunClass.ERROR, tid).encode(fingerprint=False)[:2] == b"\x01\x11"
    assert StunMessage(0xFFF, StunClass.REQUEST, tid).encode(fingerprint=False)[:2] == b"\x3e\xef"


def test_binding_request_is_a_bare_request_with_a_fresh_random_id():
    first, second = binding_request(), binding_request()
    assert first.cls == StunClass.REQUEST and first.method == BINDING and first.attributes == ()
    assert len(first.transaction_id) == 12 and first.transaction_id != second.transaction_id
    assert binding_request(TID).transaction_id == TID
    assert binding_request(TID).encode(fingerprint=False) == bytes.fromhex("000100002112a442") + TID


def test_binding_success_reports_the_source_address_xored():
    request = binding_request(TID)
    response = decode(binding_success(request, ("192.0.2.1", 32853)).encode())
    assert response.cls == StunClass.SUCCESS and response.transaction_id == TID
    assert response.get(XOR_MAPPED_ADDRESS) == bytes.fromhex("0001a147e112a643")
    assert response.xor_mapped_address == ("192.0.2.1", 32853)


def test_binding_success_takes_dual_stack_socket_addresses():
    request = binding_request()
    mapped = binding_success(request, ("::ffff:198.51.100.7", 4242, 0, 0))
    assert mapped.xor_mapped_address == ("198.51.100.7", 4242)
    v6 = binding_success(request, ("2001:db8::1", 443, 0, 0))
    assert v6.xor_mapped_address == ("2001:db8::1", 443)


def test_error_response_carries_code_reason_and_unknown_types():
    request = binding_request(TID)
    response = decode(error_response(request, 420, "Unknown Attribute", [0x7F00, CHANGE_REQUEST]).encode())
    assert response.cls == StunClass.ERROR and response.method == BINDING
    assert response.error_code == (420, "Unknown Attribute")
    assert response.unknown_attributes == (0x7F00, CHANGE_REQUEST)
    assert decode(error_response(request, 699, "").encode()).error_code == (699, "")


@pytest.mark.parametrize(
    "make, text",
    [
        (lambda: StunMessage(0x1000, StunClass.REQUEST, TID), "12 bits"),
        (lambda: StunMessage(BINDING, StunClass.REQUEST, b"short"), "not 12"),
        (lambda: StunMessage(BINDING, 4, TID), "not a valid StunClass"),
        (lambda: StunMessage(BINDING, StunClass.REQUEST, TID, ((0x10000, b""),)), "16 bits"),
        (lambda: StunMessage(BINDING, StunClass.REQUEST, TID, ((FINGERPRINT, bytes(4)),)), "computed by encode"),
        (lambda: StunMessage(BINDING, StunClass.REQUEST, TID, ((0x8100, bytes(65536)),)), "over 65535"),
        (lambda: StunMessage(BINDING, 0, TID, ((0x8100, bytes(2100)),)).encode(), "2048-byte limit"),
        (lambda: error_code_value(200, "OK"), "outside 300-699"),
        (lambda: error_code_value(400, "x" * 128), "fewer than 128"),
        (lambda: address_value(("192.0.2.1", 70000)), "outside 0-65535"),
        (lambda: address_value(("not an address", 1)), "does not appear to be"),
    ],
)
def test_building_rejects_what_cannot_go_on_the_wire(make, text):
    with pytest.raises(ValueError, match=text):
        make()


def test_integrity_sha256_round_trips_and_a_truncated_one_is_accepted():
    message = StunMessage(BINDING, StunClass.REQUEST, TID, ((USERNAME, b"alice"),))
    data = message.encode(integrity_key=KEY, integrity_sha256=True)
    assert struct.unpack_from("!HH", data, len(data) - 8 - 36) == (MESSAGE_INTEGRITY_SHA256, 32)
    assert decode(data, integrity_key=KEY) == message
    with pytest.raises(IntegrityError, match="MESSAGE-INTEGRITY-SHA256 does not match"):
        decode(data, integrity_key=b"other")
    # A 16-byte (truncated) MESSAGE-INTEGRITY-SHA256, computed here independently of the codec.
    unsigned = message.encode(fingerprint=False)
    prefix = unsigned[:2] + (len(unsigned) - 20 + 20).to_bytes(2) + unsigned[4:]
    mac = hmac.new(KEY, prefix, hashlib.sha256).digest()[:16]
    truncated = prefix + struct.pack("!HH", MESSAGE_INTEGRITY_SHA256, 16) + mac
    assert decode(truncated, integrity_key=KEY) == message


def test_fingerprint_is_crc32_xor_stun():
    data = binding_request(TID).encode()
    assert struct.unpack_from("!HHI", data, 20) == (FINGERPRINT, 4, zlib.crc32(data[:20]) ^ 0x5354554E)


# ------------------------------------------------------------- is_stun


def test_is_stun_demultiplexes_like_rfc_7983():
    assert is_stun(SAMPLE_REQUEST) and is_stun(SAMPLE_IPV4_RESPONSE)
    assert not is_stun(SAMPLE_REQUEST[:19])
    assert not is_stun(b"\x40" + SAMPLE_REQUEST[1:])  # QUIC short header range
    assert not is_stun(b"\xc0" + SAMPLE_REQUEST[1:])  # QUIC long header
    assert not is_stun(SAMPLE_REQUEST[:4] + b"\x21\x12\xa4\x43" + SAMPLE_REQUEST[8:])


# ------------------------------------------------------------- malformed input, one case each


def header(length, msg_type=0x0001, cookie=MAGIC_COOKIE, tid=TID):
    """A raw 20-byte header with whatever fields a test wants."""
    return struct.pack("!HHI", msg_type, length, cookie) + tid


def tlv(attr_type, value, pad=b"\x00"):
    """One raw attribute, padded to 4 bytes."""
    return struct.pack("!HH", attr_type, len(value)) + value + pad * (-len(value) % 4)


def message_with(*attributes, msg_type=0x0001):
    """A framed message with these raw attribute bytes and a correct length field."""
    body = b"".join(attributes)
    return header(len(body), msg_type) + body


def fingerprinted(data):
    """``data`` with a correct FINGERPRINT appended (length field updated)."""
    data = data[:2] + (len(data) - 20 + 8).to_bytes(2) + data[4:]
    return data + tlv(FINGERPRINT, (zlib.crc32(data) ^ 0x5354554E).to_bytes(4))


def test_decode_rejects_a_datagram_shorter_than_the_header():
    with pytest.raises(StunError, match="shorter than the 20-byte STUN header"):
        decode(SAMPLE_REQUEST[:19])


def test_decode_rejects_an_oversize_datagram():
    body = tlv(0x8100, bytes(MAX_MESSAGE_SIZE))
    with pytest.raises(StunError, match="exceeds the 2048-byte limit"):
        decode(message_with(body))


def test_decode_rejects_the_first_two_bits_set():
    with pytest.raises(StunError, match="first two bits"):
        decode(header(0, msg_type=0x4001))


def test_decode_rejects_a_wrong_magic_cookie():
    with pytest.raises(StunError, match="magic cookie is 0x2112a443"):
        decode(header(0, cookie=0x2112A443))


def test_decode_rejects_a_length_not_a_multiple_of_4():
    with pytest.raises(StunError, match="not a multiple of 4"):
        decode(header(6) + bytes(6))


def test_decode_rejects_a_length_that_disagrees_with_the_datagram():
    with pytest.raises(StunError, match="says 8 bytes .* carries 4"):
        decode(header(8) + bytes(4))
    with pytest.raises(StunError, match="says 0 bytes .* carries 4"):
        decode(header(0) + bytes(4))


def test_decode_rejects_an_attribute_running_past_the_end():
    body = struct.pack("!HH", SOFTWARE, 40) + b"abcd"
    with pytest.raises(StunError, match="SOFTWARE at byte 20 claims 40 bytes but only 4 remain"):
        decode(message_with(body))


def test_decode_rejects_an_unpadded_attribute():
    # Two RFC 3489-style attributes with no padding after the 5-byte value: the
    # next attribute header is read from the wrong place and runs off the end.
    body = struct.pack("!HH", SOFTWARE, 5) + b"hello" + struct.pack("!HH", 0x8100, 3) + b"abc"
    assert len(body) % 4 == 0
    with pytest.raises(StunError, match="claims .* bytes but only"):
        decode(message_with(body))


def test_decode_ignores_nonzero_padding():
    assert decode(message_with(tlv(SOFTWARE, b"abc", pad=b"\xff"))).software == "abc"


def test_decode_rejects_a_fingerprint_mismatch():
    data = bytearray(binding_request(TID).encode())
    data[-1] ^= 0x01
    with pytest.raises(StunError, match="FINGERPRINT does not match"):
        decode(bytes(data))


def test_decode_rejects_a_fingerprint_that_is_not_last():
    data = fingerprinted(header(0)) + tlv(SOFTWARE, b"late")
    data = data[:2] + (len(data) - 20).to_bytes(2) + data[4:]
    with pytest.raises(StunError, match="FINGERPRINT must be the last attribute, but SOFTWARE follows it"):
        decode(data)


def test_decode_rejects_a_fingerprint_of_the_wrong_size():
    with pytest.raises(StunError, match="FINGERPRINT value is 8 bytes, not 4"):
        decode(message_with(tlv(FINGERPRINT, bytes(8))))


def test_decode_rejects_an_integrity_mismatch():
    data = bytearray(decode(SAMPLE_REQUEST).encode(integrity_key=KEY, fingerprint=False))
    data[30] ^= 0x01  # inside SOFTWARE, covered by the HMAC
    with pytest.raises(IntegrityError, match="does not match"):
        decode(bytes(data), integrity_key=KEY)


def test_decode_rejects_integrity_attributes_of_the_wrong_size():
    with pytest.raises(StunError, match="MESSAGE-INTEGRITY value is 16 bytes, not 20"):
        decode(message_with(tlv(MESSAGE_INTEGRITY, bytes(16))))
    with pytest.raises(StunError, match="MESSAGE-INTEGRITY-SHA256 value is 12 bytes"):
        decode(message_with(tlv(MESSAGE_INTEGRITY_SHA256, bytes(12))))
    with pytest.raises(StunError, match="MESSAGE-INTEGRITY-SHA256 value is 18 bytes"):
        decode(message_with(tlv(MESSAGE_INTEGRITY_SHA256, bytes(18))))


def test_decode_with_a_key_requires_an_integrity_attribute():
    with pytest.raises(StunError, match="has no MESSAGE-INTEGRITY") as caught:
        decode(binding_request(TID).encode(), integrity_key=KEY)
    assert caught.value.code == 400 and caught.value.parsed.transaction_id == TID


def test_decode_reports_unknown_comprehension_required_attributes_for_a_420():
    data = message_with(tlv(CHANGE_REQUEST, bytes(4)), tlv(0x7F00, b"x"), tlv(0x8100, b"optional"), tlv(0x7F00, b""))
    with pytest.raises(UnknownAttributesError, match="0x0003, 0x7f00") as caught:
        decode(data)
    error = caught.value
    assert error.code == 420 and error.unknown == (CHANGE_REQUEST, 0x7F00)
    answer = decode(error_response(error.parsed, 420, "Unknown Attribute", error.unknown).encode())
    assert answer.transaction_id == TID and answer.unknown_attributes == (CHANGE_REQUEST, 0x7F00)
    # A caller that understands CHANGE-REQUEST says so.
    with pytest.raises(UnknownAttributesError) as caught:
        decode(data, comprehended={CHANGE_REQUEST})
    assert caught.value.unknown == (0x7F00,)


def test_decode_keeps_unknown_optional_attributes_even_repeated():
    data = message_with(tlv(0x8100, b"a"), tlv(0x8100, b"b"))
    assert decode(data).attributes == ((0x8100, b"a"), (0x8100, b"b"))


def test_decode_checks_integrity_before_unknown_attributes():
    message = StunMessage(BINDING, StunClass.REQUEST, TID, ((0x7F00, b""),))
    with pytest.raises(IntegrityError):
        decode(message.encode(integrity_key=b"other"), integrity_key=KEY)
    with pytest.raises(UnknownAttributesError):
        decode(message.encode(integrity_key=KEY), integrity_key=KEY)


def test_decode_rejects_a_bad_address_family():
    with pytest.raises(StunError, match="unknown address family 0x03"):
        decode(message_with(tlv(XOR_MAPPED_ADDRESS, bytes.fromhex("0003a147e112a643"))))


def test_decode_rejects_an_address_of_the_wrong_size():
    with pytest.raises(StunError, match="family 0x01 is 20 bytes, not 8"):
        decode(message_with(tlv(MAPPED_ADDRESS, bytes.fromhex("00010050") + bytes(16))))
    with pytest.raises(StunError, match="family 0x02 is 8 bytes, not 20"):
        decode(message_with(tlv(XOR_MAPPED_ADDRESS, bytes.fromhex("0002a147e112a643"))))
    with pytest.raises(StunError, match="shorter than its 4-byte head"):
        decode(message_with(tlv(MAPPED_ADDRESS, b"\x00\x01")))


def test_decode_rejects_a_repeated_address():
    first = tlv(XOR_MAPPED_ADDRESS, xor_address_value(("192.0.2.1", 1), TID))
    second = tlv(XOR_MAPPED_ADDRESS, xor_address_value(("203.0.113.9", 2), TID))
    with pytest.raises(StunError, match="XOR-MAPPED-ADDRESS appears more than once"):
        decode(message_with(first, second))


def test_decode_rejects_malformed_error_codes():
    with pytest.raises(StunError, match="class 2 number 0 is not a code in 300-699"):
        decode(message_with(tlv(ERROR_CODE, bytes((0, 0, 2, 0)))))
    with pytest.raises(StunError, match="class 4 number 100"):
        decode(message_with(tlv(ERROR_CODE, bytes((0, 0, 4, 100)))))
    with pytest.raises(StunError, match="ERROR-CODE value is 3 bytes"):
        decode(message_with(tlv(ERROR_CODE, bytes(3))))
    with pytest.raises(StunError, match="ERROR-CODE reason is not valid UTF-8"):
        decode(message_with(tlv(ERROR_CODE, bytes((0, 0, 4, 0)) + b"\xff")))


def test_decode_rejects_an_odd_unknown_attributes_list():
    with pytest.raises(StunError, match="UNKNOWN-ATTRIBUTES value is 3 bytes"):
        decode(message_with(tlv(UNKNOWN_ATTRIBUTES, b"\x00\x01\x00")))


def test_decode_rejects_bad_text_attributes():
    with pytest.raises(StunError, match="SOFTWARE is not valid UTF-8"):
        decode(message_with(tlv(SOFTWARE, b"\xc3\x28")))
    with pytest.raises(StunError, match="SOFTWARE is 764 bytes, over the 763-byte limit"):
        decode(message_with(tlv(SOFTWARE, b"a" * 764)))
    with pytest.raises(StunError, match="USERNAME is 513 bytes"):
        decode(message_with(tlv(USERNAME, b"u" * 513)))


def test_decode_rejects_fixed_size_attributes_of_the_wrong_size():
    with pytest.raises(StunError, match="PRIORITY value is 2 bytes, not 4"):
        decode(message_with(tlv(PRIORITY, b"\x00\x01")))
    with pytest.raises(StunError, match="ICE-CONTROLLED value is 4 bytes, not 8"):
        decode(message_with(tlv(ICE_CONTROLLED, bytes(4))))


def test_decode_ignores_attributes_after_message_integrity():
    signed = StunMessage(BINDING, StunClass.REQUEST, TID, ((USERNAME, b"alice"),)).encode(
        integrity_key=KEY, fingerprint=False
    )
    tail = tlv(0x7F00, b"smuggled") + tlv(USERNAME, b"mallory")
    data = fingerprinted(signed[:2] + (len(signed) - 20 + len(tail)).to_bytes(2) + signed[4:] + tail)
    message = decode(data, integrity_key=KEY)
    assert message.attributes == ((USERNAME, b"alice"),)


def test_decode_checks_both_integrity_attributes_when_both_are_present():
    signed = binding_request(TID).encode(integrity_key=KEY, fingerprint=False)
    prefix = signed[:2] + (len(signed) - 20 + 36).to_bytes(2) + signed[4:]
    good = prefix + tlv(MESSAGE_INTEGRITY_SHA256, hmac.new(KEY, prefix, hashlib.sha256).digest())
    assert decode(good, integrity_key=KEY) == binding_request(TID)
    bad = prefix + tlv(MESSAGE_INTEGRITY_SHA256, bytes(32))
    with pytest.raises(IntegrityError, match="MESSAGE-INTEGRITY-SHA256 does not match"):
        decode(bad, integrity_key=KEY)


def test_decode_ignores_message_integrity_after_the_sha256_one():
    signed = binding_request(TID).encode(integrity_key=KEY, integrity_sha256=True, fingerprint=False)
    tail = tlv(MESSAGE_INTEGRITY, bytes(20))  # garbage, but ignored after MESSAGE-INTEGRITY-SHA256
    data = signed[:2] + (len(signed) - 20 + len(tail)).to_bytes(2) + signed[4:] + tail
    assert decode(data, integrity_key=KEY) == binding_request(TID)


def test_accessors_on_a_hand_built_message_raise_stun_error_for_bad_values():
    message = StunMessage(BINDING, StunClass.SUCCESS, TID, ((XOR_MAPPED_ADDRESS, b"\x00\x09\x00\x00"),))
    with pytest.raises(StunError, match="unknown address family"):
        message.xor_mapped_address
    assert message.mapped_address is None and message.error_code is None and message.unknown_attributes == ()


# ------------------------------------------------------------- SASLprep


@pytest.mark.parametrize(
    "text, prepared",
    [
        ("I\u00adX", "IX"),  # soft hyphen mapped to nothing
        ("user", "user"),
        ("USER", "USER"),
        ("\u00aa", "a"),  # NFKC
        ("\u2168", "IX"),  # NFKC
        ("a\u00a0b", "a b"),  # non-ASCII space mapped to space
        (PASSWORD, PASSWORD),
        ("\u0627\u0031\u0628", "\u0627\u0031\u0628"),  # right-to-left, starting and ending so
    ],
)
def test_saslprep_rfc4013_examples(text, prepared):
    assert saslprep(text) == prepared


@pytest.mark.parametrize(
    "text",
    [
        "\u0007",  # control character
        "\u0627\u0031",  # right-to-left, ending in a digit
        "\u0627a",  # right-to-left mixed with left-to-right
        "a\ue000",  # private use
        "\U000e0001",  # tagging character
        "a\u0221",  # unassigned in Unicode 3.2
    ],
)
def test_saslprep_refuses_prohibited_strings(text):
    with pytest.raises(ValueError):
        saslprep(text)


# ------------------------------------------------------------- properties

ADDRESSES = st.tuples(st.ip_addresses().map(str), st.integers(0, 0xFFFF))
TIDS = st.binary(min_size=12, max_size=12)
TEXT = st.text(max_size=40)


@st.composite
def messages(draw):
    """Random messages: interpreted attributes with valid values and opaque optional ones."""
    tid = draw(TIDS)
    attribute = st.one_of(
        st.tuples(st.integers(0x8100, 0xFFFF).filter(lambda t: t != FINGERPRINT), st.binary(max_size=64)),
        ADDRESSES.map(lambda a: (XOR_MAPPED_ADDRESS, xor_address_value(a, tid))),
        ADDRESSES.map(lambda a: (MAPPED_ADDRESS, address_value(a))),
        TEXT.map(lambda s: (SOFTWARE, s.encode())),
        TEXT.map(lambda s: (USERNAME, s.encode())),
        st.builds(error_code_value, st.integers(300, 699), TEXT).map(lambda v: (ERROR_CODE, v)),
        st.binary(min_size=4, max_size=4).map(lambda v: (PRIORITY, v)),
    )
    attributes = draw(st.lists(attribute, max_size=8, unique_by=lambda a: a[0]))
    return StunMessage(draw(st.integers(0, 0xFFF)), draw(st.sampled_from(StunClass)), tid, tuple(attributes))


ENCODINGS = st.fixed_dictionaries(
    {
        "integrity_key": st.none() | st.binary(max_size=40),
        "integrity_sha256": st.booleans(),
        "fingerprint": st.booleans(),
    }
)


@given(messages(), ENCODINGS)
def test_encode_then_decode_gives_the_message_back(message, options):
    data = message.encode(**options)
    assert len(data) % 4 == 0 and is_stun(data) == (data[0] < 4)
    assert parse_header(data).transaction_id == message.transaction_id
    assert decode(data, integrity_key=options["integrity_key"]) == message


@given(ADDRESSES, TIDS)
def test_addresses_round_trip_plain_and_xored(address, tid):
    ip = ipaddress.ip_address(address[0])
    expected = (str(getattr(ip, "ipv4_mapped", None) or ip), address[1])
    message = StunMessage(
        BINDING,
        StunClass.SUCCESS,
        tid,
        ((XOR_MAPPED_ADDRESS, xor_address_value(address, tid)), (MAPPED_ADDRESS, address_value(address))),
    )
    decoded = decode(message.encode())
    assert decoded.xor_mapped_address == expected and decoded.mapped_address == expected


def decodes_or_refuses(data, **options):
    """decode ``data``; only a message or StunError may come out."""
    try:
        return decode(data, **options)
    except StunError:
        return None


@settings(max_examples=300)
@given(st.binary(max_size=120))
def test_fuzz_random_bytes(data):
    decodes_or_refuses(data)
    decodes_or_refuses(data, integrity_key=KEY)


INTERESTING_TYPES = st.sampled_from(
    [MAPPED_ADDRESS, XOR_MAPPED_ADDRESS, USERNAME, SOFTWARE, ERROR_CODE, UNKNOWN_ATTRIBUTES, PRIORITY,
     ICE_CONTROLLED, MESSAGE_INTEGRITY, MESSAGE_INTEGRITY_SHA256, FINGERPRINT, CHANGE_REQUEST, 0x8100]
) | st.integers(0, 0xFFFF)


@st.composite
def framed_garbage(draw):
    """A sound header over attributes with random types, values and (sometimes lying) lengths."""
    body = b""
    for attr_type, value, lie in draw(
        st.lists(st.tuples(INTERESTING_TYPES, st.binary(max_size=40), st.none() | st.integers(0, 0xFFFF)), max_size=6)
    ):
        length = len(value) if lie is None else lie
        body += struct.pack("!HH", attr_type, length) + value + bytes(-len(value) % 4)
    data = header(len(body), draw(st.integers(0, 0x3FFF)), tid=draw(TIDS)) + body
    return fingerprinted(data) if draw(st.booleans()) else data


@settings(max_examples=300)
@given(framed_garbage())
def test_fuzz_framed_attributes(data):
    decodes_or_refuses(data)
    decodes_or_refuses(data, integrity_key=KEY, comprehended=())


MUTATIONS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("append"), st.integers(1, 15), st.just(0)),
    st.tuples(st.just("length"), st.integers(0, 0xFFFF), st.just(0)),
)


def mutate(data, mutation):
    """``data`` changed by one mutation: append zeros, flip a byte, truncate, or rewrite the length field."""
    kind, n, value = mutation
    if kind == "append":
        return data + bytes(n)
    if not data:
        return data
    if kind == "flip":
        i = n % len(data)
        return data[:i] + bytes((data[i] ^ value,)) + data[i + 1 :]
    if kind == "truncate":
        return data[: n % len(data)]
    return data[:2] + n.to_bytes(2) + data[4:]


@settings(max_examples=300)
@given(messages(), ENCODINGS, st.lists(MUTATIONS, min_size=1, max_size=3))
def test_fuzz_mutated_valid_messages(message, options, mutations):
    data = message.encode(**options)
    for mutation in mutations:
        data = mutate(data, mutation)
    decodes_or_refuses(data)
    decodes_or_refuses(data, integrity_key=options["integrity_key"] or KEY)


@given(messages(), st.integers(0, 10_000), st.integers(1, 255))
def test_fingerprint_catches_any_single_byte_change(message, position, flip):
    data = bytearray(message.encode())
    covered = len(data) - 8  # everything before FINGERPRINT, plus its value
    position %= len(data) - 4
    data[position if position < covered else position + 4] ^= flip
    with pytest.raises(StunError):
        decode(bytes(data))


# ------------------------------------------------------------- client transaction


def new_transaction(**options):
    return ClientTransaction(binding_request(TID).encode(), 0.0, **options)


def run_clock(tx, until):
    """Drive ``tx`` with a fake clock that jumps from wake time to wake time; return the send times."""
    sent = []
    while tx.wake_time is not None and tx.wake_time <= until:
        now = tx.wake_time
        if tx.datagram_to_send(now) is not None:
            sent.append(now)
        tx.timeout(now)
    return sent


def test_transaction_retransmits_on_the_rfc_8489_schedule_then_times_out():
    tx = new_transaction()
    assert tx.next_send_time == 0.0 and tx.datagram_to_send(-0.1) is None
    assert run_clock(tx, until=39.4) == [0.0, 0.5, 1.5, 3.5, 7.5, 15.5, 31.5]
    assert tx.requests_sent == 7 and tx.next_send_time is None and tx.deadline == 39.5
    assert not tx.timeout(39.4) and not tx.done
    assert tx.timeout(39.5) and tx.done and tx.wake_time is None
    with pytest.raises(TransactionTimeout, match="after 7 requests"):
        tx.result()
    assert tx.datagram_to_send(100.0) is None


def test_transaction_datagram_is_the_request_and_not_sent_early():
    tx = new_transaction()
    assert tx.datagram_to_send(0.0) == binding_request(TID).encode()
    assert tx.datagram_to_send(0.49) is None
    assert tx.datagram_to_send(0.5) is not None


def test_a_response_stops_retransmission():
    tx = new_transaction()
    assert run_clock(tx, until=1.5) == [0.0, 0.5, 1.5]
    response = binding_success(binding_request(TID), ("192.0.2.1", 32853))
    assert tx.handle_response(response)
    assert tx.done and tx.next_send_time is None and tx.wake_time is None
    assert tx.datagram_to_send(3.5) is None and not tx.timeout(100.0)
    assert tx.result() is response
    assert not tx.handle_response(response)  # a duplicate changes nothing


def test_an_error_response_also_ends_the_transaction():
    tx = new_transaction()
    tx.datagram_to_send(0.0)
    assert tx.handle_response(error_response(binding_request(TID), 400, "Bad Request"))
    assert tx.result().error_code == (400, "Bad Request")


def test_messages_that_do_not_answer_the_request_are_ignored():
    tx = new_transaction()
    tx.datagram_to_send(0.0)
    other_id = binding_success(binding_request(bytes(12)), ("192.0.2.1", 1))
    other_method = StunMessage(0x003, StunClass.SUCCESS, TID)
    not_a_response = binding_request(TID)
    for message in (other_id, other_method, not_a_response):
        assert not tx.handle_response(message)
    assert not tx.done and tx.next_send_time == 0.5
    with pytest.raises(RuntimeError, match="still running"):
        tx.result()


def test_a_late_send_shifts_the_rest_of_the_schedule():
    tx = new_transaction()
    tx.datagram_to_send(0.0)
    tx.datagram_to_send(2.0)  # the caller woke late: one send, the next 1 s (2 x RTO) after it
    assert tx.next_send_time == 3.0


def test_transaction_parameters_are_configurable():
    tx = new_transaction(rto=0.1, rc=3, rm=4)
    assert run_clock(tx, until=10.0) == pytest.approx([0.0, 0.1, 0.3])
    assert tx.done and tx.requests_sent == 3


@pytest.mark.parametrize("options", [{"rto": 0}, {"rc": 0}, {"rm": 0}])
def test_transaction_rejects_bad_parameters(options):
    with pytest.raises(ValueError, match="need rto > 0"):
        new_transaction(**options)


def test_transaction_sends_only_requests():
    with pytest.raises(ValueError, match="not a success message"):
        ClientTransaction(binding_success(binding_request(), ("192.0.2.1", 1)).encode(), 0.0)
    with pytest.raises(StunError):
        ClientTransaction(b"not stun", 0.0)
