"""STUN messages (RFC 8489): build, encode, decode and check them, with no I/O.

A message is a 20-byte header (type, length, magic cookie, 96-bit transaction
id) followed by TLV attributes padded to 4 bytes.  ``StunMessage`` holds the
method, class, transaction id and the attributes as raw ``(type, value)``
pairs; MESSAGE-INTEGRITY, MESSAGE-INTEGRITY-SHA256 and FINGERPRINT are not
kept there: ``encode`` computes them and ``decode`` checks them.

``decode`` trusts nothing in the datagram.  Whatever is wrong with it raises
``StunError`` (or a subclass): its ``code`` is the error response a server
would answer with (400, 401, 420) and ``parsed`` is the message when enough of
it was sound to answer at all.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import secrets
import stringprep
import struct
import unicodedata
import zlib
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import NamedTuple

MAGIC_COOKIE = 0x2112A442
HEADER_SIZE = 20
TRANSACTION_ID_SIZE = 12
MAX_MESSAGE_SIZE = 2048
"""Largest datagram ``decode`` reads or ``encode`` writes: STUN over UDP stays under the path MTU."""

BINDING = 0x001

_COOKIE_BYTES = MAGIC_COOKIE.to_bytes(4)
_FINGERPRINT_XOR = 0x5354554E
_MAX_TEXT_BYTES = 763  # SOFTWARE and reason phrases: fewer than 128 characters, up to 763 bytes
_MAX_USERNAME_BYTES = 512  # "less than 513 bytes" (RFC 5389; RFC 8489 says fewer than 509)


class StunClass(enum.IntEnum):
    """The two class bits of a message type."""

    REQUEST = 0b00
    INDICATION = 0b01
    SUCCESS = 0b10
    ERROR = 0b11


# Attribute types: RFC 8489, plus the ICE (RFC 8445) and NAT behaviour
# discovery (RFC 5780) ones this layer meets.  0x0000-0x7FFF are
# comprehension-required, 0x8000-0xFFFF comprehension-optional.
MAPPED_ADDRESS = 0x0001
CHANGE_REQUEST = 0x0003
USERNAME = 0x0006
MESSAGE_INTEGRITY = 0x0008
ERROR_CODE = 0x0009
UNKNOWN_ATTRIBUTES = 0x000A
MESSAGE_INTEGRITY_SHA256 = 0x001C
XOR_MAPPED_ADDRESS = 0x0020
PRIORITY = 0x0024
USE_CANDIDATE = 0x0025
SOFTWARE = 0x8022
ALTERNATE_SERVER = 0x8023
FINGERPRINT = 0x8028
ICE_CONTROLLED = 0x8029
ICE_CONTROLLING = 0x802A
RESPONSE_ORIGIN = 0x802B
OTHER_ADDRESS = 0x802C

COMPREHENDED = frozenset(
    {MAPPED_ADDRESS, USERNAME, ERROR_CODE, UNKNOWN_ATTRIBUTES, XOR_MAPPED_ADDRESS, PRIORITY, USE_CANDIDATE}
)
"""Comprehension-required types ``decode`` accepts by default (the integrity attributes are always understood)."""

_INTEGRITY_TYPES = (MESSAGE_INTEGRITY, MESSAGE_INTEGRITY_SHA256)
_COMPUTED_TYPES = (MESSAGE_INTEGRITY, MESSAGE_INTEGRITY_SHA256, FINGERPRINT)


class StunError(ValueError):
    """A datagram is not an acceptable STUN message; the text says why.

    ``code`` is the error response a server would send (400 Bad Request here).
    ``parsed`` is the decoded message when the failure came after the message
    was read, so a server can answer it; None when the datagram is too broken
    to answer (RFC 8489 says to drop those silently).
    """

    code = 400

    def __init__(self, reason: str, parsed: StunMessage | None = None) -> None:
        super().__init__(reason)
        self.parsed = parsed


class IntegrityError(StunError):
    """MESSAGE-INTEGRITY(-SHA256) does not match the key: answer 401."""

    code = 401


class UnknownAttributesError(StunError):
    """The message holds comprehension-required attributes the caller does not understand.

    ``unknown`` lists their types (first-seen order, no repeats), ready for
    ``error_response(exc.parsed, 420, "Unknown Attribute", exc.unknown)``.
    """

    code = 420

    def __init__(self, parsed: StunMessage, unknown: tuple[int, ...]) -> None:
        names = ", ".join(f"0x{t:04x}" for t in unknown)
        super().__init__(f"unknown comprehension-required attributes: {names}", parsed)
        self.unknown = unknown


class StunHeader(NamedTuple):
    """The fixed 20-byte header of a message that passed ``parse_header``."""

    method: int
    cls: StunClass
    transaction_id: bytes
    length: int


# ---------------------------------------------------------------- message


@dataclass(frozen=True)
class StunMessage:
    """One STUN message: a 12-bit method, a class, a 12-byte transaction id and its attributes.

    ``attributes`` is a tuple of ``(type, value)`` pairs in wire order, values
    unpadded.  Construction checks the field ranges and raises ValueError; it
    refuses MESSAGE-INTEGRITY(-SHA256) and FINGERPRINT, which ``encode`` adds.
    """

    method: int
    cls: StunClass
    transaction_id: bytes
    attributes: tuple[tuple[int, bytes], ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.method <= 0xFFF:
            raise ValueError(f"method {self.method:#x} does not fit in 12 bits")
        if len(self.transaction_id) != TRANSACTION_ID_SIZE:
            raise ValueError(f"transaction id is {len(self.transaction_id)} bytes, not {TRANSACTION_ID_SIZE}")
        object.__setattr__(self, "cls", StunClass(self.cls))
        object.__setattr__(self, "transaction_id", bytes(self.transaction_id))
        object.__setattr__(self, "attributes", tuple(_checked_attribute(a) for a in self.attributes))

    def get(self, attr_type: int) -> bytes | None:
        """The value of the first attribute of this type, or None."""
        return next((value for t, value in self.attributes if t == attr_type), None)

    def address(self, attr_type: int) -> tuple[str, int] | None:
        """``(host, port)`` from a MAPPED-ADDRESS-style attribute, or None; StunError if malformed."""
        value = self.get(attr_type)
        return None if value is None else _parse_address(value, bytes(16))

    def xor_address(self, attr_type: int) -> tuple[str, int] | None:
        """``(host, port)`` from an XOR-MAPPED-ADDRESS-style attribute, or None; StunError if malformed."""
        value = self.get(attr_type)
        return None if value is None else _parse_address(value, _COOKIE_BYTES + self.transaction_id)

    @property
    def xor_mapped_address(self) -> tuple[str, int] | None:
        """The reflexive address from XOR-MAPPED-ADDRESS, or None."""
        return self.xor_address(XOR_MAPPED_ADDRESS)

    @property
    def mapped_address(self) -> tuple[str, int] | None:
        """The address from MAPPED-ADDRESS (sent by RFC 3489-era servers), or None."""
        return self.address(MAPPED_ADDRESS)

    @property
    def error_code(self) -> tuple[int, str] | None:
        """``(code, reason)`` from ERROR-CODE, or None."""
        value = self.get(ERROR_CODE)
        return None if value is None else _parse_error_code(value)

    @property
    def unknown_attributes(self) -> tuple[int, ...]:
        """The types listed in UNKNOWN-ATTRIBUTES (empty when absent)."""
        value = self.get(UNKNOWN_ATTRIBUTES)
        return () if value is None else _parse_unknown_attributes(value)

    @property
    def software(self) -> str | None:
        """The SOFTWARE text, or None."""
        value = self.get(SOFTWARE)
        return None if value is None else _parse_text(value, _MAX_TEXT_BYTES, "SOFTWARE")

    @property
    def username(self) -> str | None:
        """The USERNAME text, or None."""
        value = self.get(USERNAME)
        return None if value is None else _parse_text(value, _MAX_USERNAME_BYTES, "USERNAME")

    def encode(
        self,
        *,
        integrity_key: bytes | None = None,
        integrity_sha256: bool = False,
        fingerprint: bool = True,
        pad_byte: int = 0,
    ) -> bytes:
        """The datagram for this message.

        With ``integrity_key``, a MESSAGE-INTEGRITY (HMAC-SHA1) follows the
        attributes, or a 32-byte MESSAGE-INTEGRITY-SHA256 when
        ``integrity_sha256``; with ``fingerprint``, FINGERPRINT comes last.
        Padding bytes are ``pad_byte``: RFC 8489 says zero, RFC 5769's test
        vectors use 0x20.  ValueError if the result exceeds MAX_MESSAGE_SIZE.
        """
        body = b"".join(_tlv(t, value, pad_byte) for t, value in self.attributes)
        data = _header(self, len(body)) + body
        if integrity_key is not None:
            kind, size = (MESSAGE_INTEGRITY_SHA256, 32) if integrity_sha256 else (MESSAGE_INTEGRITY, 20)
            data = _with_length(data, len(data) - HEADER_SIZE + 4 + size)
            data += _tlv(kind, _mac(data, integrity_key, kind, size), pad_byte)
        if fingerprint:
            data = _with_length(data, len(data) - HEADER_SIZE + 8)
            data += _tlv(FINGERPRINT, _fingerprint(data).to_bytes(4), pad_byte)
        if len(data) > MAX_MESSAGE_SIZE:
            raise ValueError(f"encoded message is {len(data)} bytes, over the {MAX_MESSAGE_SIZE}-byte limit")
        return data


def _checked_attribute(attribute: tuple[int, bytes]) -> tuple[int, bytes]:
    """``attribute`` as an ``(int, bytes)`` pair, after checking it can go on the wire."""
    attr_type, value = attribute
    if not 0 <= attr_type <= 0xFFFF:
        raise ValueError(f"attribute type {attr_type:#x} does not fit in 16 bits")
    if attr_type in _COMPUTED_TYPES:
        raise ValueError(f"{_name(attr_type)} is computed by encode(); do not pass it as an attribute")
    value = bytes(value)
    if len(value) > 0xFFFF:
        raise ValueError(f"{_name(attr_type)} value is {len(value)} bytes, over 65535")
    return attr_type, value


# ---------------------------------------------------------------- building


def new_transaction_id() -> bytes:
    """A fresh transaction id: 96 bits from the OS's cryptographic random source."""
    return secrets.token_bytes(TRANSACTION_ID_SIZE)


def binding_request(transaction_id: bytes | None = None) -> StunMessage:
    """A Binding request with no attributes (a fresh transaction id unless one is given)."""
    if transaction_id is None:
        transaction_id = new_transaction_id()
    return StunMessage(BINDING, StunClass.REQUEST, transaction_id)


def binding_success(request: StunMessage, mapped_address: tuple) -> StunMessage:
    """The Binding success response telling ``request``'s sender it came from ``mapped_address``.

    ``mapped_address`` is a socket address tuple, ``(host, port)`` or the
    4-tuple of an IPv6 socket; an IPv4-mapped IPv6 host is reported as IPv4.
    """
    value = xor_address_value(mapped_address, request.transaction_id)
    return StunMessage(request.method, StunClass.SUCCESS, request.transaction_id, ((XOR_MAPPED_ADDRESS, value),))


def error_response(request: StunMessage, code: int, reason: str, unknown: Iterable[int] = ()) -> StunMessage:
    """The error response to ``request`` with ERROR-CODE ``code``/``reason``, listing ``unknown`` types (for 420)."""
    attributes = [(ERROR_CODE, error_code_value(code, reason))]
    unknown = tuple(unknown)
    if unknown:
        attributes.append((UNKNOWN_ATTRIBUTES, unknown_attributes_value(unknown)))
    return StunMessage(request.method, StunClass.ERROR, request.transaction_id, tuple(attributes))


def address_value(address: tuple) -> bytes:
    """The MAPPED-ADDRESS-format value for a socket address tuple."""
    return _address_value(address, bytes(16))


def xor_address_value(address: tuple, transaction_id: bytes) -> bytes:
    """The XOR-MAPPED-ADDRESS-format value for a socket address tuple in the given transaction."""
    return _address_value(address, _COOKIE_BYTES + transaction_id)


def error_code_value(code: int, reason: str) -> bytes:
    """The ERROR-CODE value for ``code`` (300-699) and a reason phrase of fewer than 128 characters."""
    if not 300 <= code <= 699:
        raise ValueError(f"error code {code} is outside 300-699")
    if len(reason) >= 128:
        raise ValueError(f"reason phrase is {len(reason)} characters; STUN allows fewer than 128")
    return bytes((0, 0, code // 100, code % 100)) + reason.encode()


def unknown_attributes_value(types: Iterable[int]) -> bytes:
    """The UNKNOWN-ATTRIBUTES value listing ``types``."""
    return b"".join(t.to_bytes(2) for t in types)


def _address_value(address: tuple, mask: bytes) -> bytes:
    """family, port and address of ``address``, the port and address XORed with ``mask``."""
    host, port = address[0], address[1]
    ip = ipaddress.ip_address(host)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if not 0 <= port <= 0xFFFF:
        raise ValueError(f"port {port} is outside 0-65535")
    family = 0x01 if ip.version == 4 else 0x02
    masked = bytes(a ^ m for a, m in zip(ip.packed, mask))
    return bytes((0, family)) + (port ^ int.from_bytes(mask[:2])).to_bytes(2) + masked


# ---------------------------------------------------------------- encoding


def _type_field(method: int, cls: int) -> int:
    """The 14-bit message type: method bits M11-M0 with class bits C1, C0 interleaved (RFC 8489 fig. 3)."""
    return (
        ((method & 0xF80) << 2)
        | ((method & 0x070) << 1)
        | (method & 0x00F)
        | ((cls & 0b10) << 7)
        | ((cls & 0b01) << 4)
    )


def _split_type(message_type: int) -> tuple[int, StunClass]:
    """Method and class from a 14-bit message type (inverse of ``_type_field``)."""
    method = (message_type & 0x000F) | ((message_type & 0x00E0) >> 1) | ((message_type & 0x3E00) >> 2)
    cls = ((message_type >> 7) & 0b10) | ((message_type >> 4) & 0b01)
    return method, StunClass(cls)


def _header(message: StunMessage, length: int) -> bytes:
    """The 20-byte header of ``message`` with ``length`` bytes of attributes."""
    message_type = _type_field(message.method, message.cls)
    return struct.pack("!HHI", message_type, length, MAGIC_COOKIE) + message.transaction_id


def _tlv(attr_type: int, value: bytes, pad_byte: int) -> bytes:
    """One attribute on the wire: type, length, value, padding to 4 bytes."""
    return struct.pack("!HH", attr_type, len(value)) + value + bytes((pad_byte,)) * (-len(value) % 4)


def _with_length(data: bytes, length: int) -> bytes:
    """``data`` with the header's message length field set to ``length``."""
    return data[:2] + length.to_bytes(2) + data[4:]


def _mac(prefix: bytes, key: bytes, kind: int, size: int) -> bytes:
    """The HMAC for an integrity attribute of ``kind`` and value ``size`` that follows ``prefix``.

    The header length is made to end at that attribute (RFC 8489 14.5/14.6);
    a MESSAGE-INTEGRITY-SHA256 shorter than 32 bytes is the truncated HMAC.
    """
    digest = hashlib.sha1 if kind == MESSAGE_INTEGRITY else hashlib.sha256
    adjusted = _with_length(prefix, len(prefix) - HEADER_SIZE + 4 + size)
    return hmac.new(key, adjusted, digest).digest()[:size]


def _fingerprint(prefix: bytes) -> int:
    """CRC-32 of ``prefix`` XOR 0x5354554e, the header length ending after a FINGERPRINT that follows it."""
    adjusted = _with_length(prefix, len(prefix) - HEADER_SIZE + 8)
    return zlib.crc32(adjusted) ^ _FINGERPRINT_XOR


# ---------------------------------------------------------------- decoding


def is_stun(data: bytes) -> bool:
    """Whether a datagram on a shared socket is STUN: first byte 0-3 (RFC 7983) and the magic cookie.

    A cheap demultiplexing test, not validation: ``decode`` does that.
    """
    return len(data) >= HEADER_SIZE and data[0] < 4 and data[4:8] == _COOKIE_BYTES


def parse_header(data: bytes) -> StunHeader:
    """The header of ``data``, after checking it frames exactly one STUN message; StunError otherwise."""
    if len(data) > MAX_MESSAGE_SIZE:
        raise StunError(f"datagram of {len(data)} bytes exceeds the {MAX_MESSAGE_SIZE}-byte limit")
    if len(data) < HEADER_SIZE:
        raise StunError(f"datagram of {len(data)} bytes is shorter than the {HEADER_SIZE}-byte STUN header")
    message_type, length, cookie = struct.unpack_from("!HHI", data)
    if message_type & 0xC000:
        raise StunError("the first two bits of a STUN message must be zero")
    if cookie != MAGIC_COOKIE:
        raise StunError(f"magic cookie is {cookie:#010x}, not {MAGIC_COOKIE:#010x}")
    if length % 4:
        raise StunError(f"message length {length} is not a multiple of 4")
    if HEADER_SIZE + length != len(data):
        raise StunError(f"header says {length} bytes of attributes but the datagram carries {len(data) - HEADER_SIZE}")
    method, cls = _split_type(message_type)
    return StunHeader(method, cls, bytes(data[8:HEADER_SIZE]), length)


def decode(
    data: bytes,
    *,
    integrity_key: bytes | None = None,
    comprehended: Collection[int] = COMPREHENDED,
) -> StunMessage:
    """The message in ``data``, after every check that applies; StunError (or a subclass) otherwise.

    Always checked: framing (``parse_header``), attribute bounds, FINGERPRINT
    (value, and that it is last), the lengths of integrity attributes, the
    values of the attribute types this module interprets, and that none of
    those appears twice.  With ``integrity_key``: the message must carry
    MESSAGE-INTEGRITY or MESSAGE-INTEGRITY-SHA256 and every one present must
    match (IntegrityError otherwise).  Last, comprehension-required types not
    in ``comprehended`` raise UnknownAttributesError.  Attributes that follow
    an integrity attribute, other than FINGERPRINT (and -SHA256 after
    MESSAGE-INTEGRITY), are ignored as RFC 8489 section 9 requires.
    """
    header = parse_header(data)
    data = bytes(data)
    attributes, integrity, fingerprint = _walk(data)
    if fingerprint is not None:
        _check_fingerprint(data, *fingerprint)
    for kind, _offset, value in integrity:
        _check_integrity_size(kind, value)
    _check_values(attributes)
    message = StunMessage(header.method, header.cls, header.transaction_id, tuple(attributes))
    if integrity_key is not None:
        _check_integrity(data, integrity, integrity_key, message)
    unknown = tuple(dict.fromkeys(t for t, _ in attributes if t < 0x8000 and t not in comprehended))
    if unknown:
        raise UnknownAttributesError(message, unknown)
    return message


def _walk(data: bytes) -> tuple[list[tuple[int, bytes]], list[tuple[int, int, bytes]], tuple[int, bytes] | None]:
    """Split the attributes of a framed message into plain ones, integrity ones and FINGERPRINT.

    Returns ``[(type, value)]``, ``[(type, offset, value)]`` and
    ``(offset, value)`` or None.  Refuses anything after FINGERPRINT.
    """
    attributes: list[tuple[int, bytes]] = []
    integrity: list[tuple[int, int, bytes]] = []
    fingerprint: tuple[int, bytes] | None = None
    offset = HEADER_SIZE
    while offset < len(data):
        attr_type, value, end = _read_attribute(data, offset)
        kinds = [kind for kind, _, _ in integrity]
        if fingerprint is not None:
            raise StunError(f"FINGERPRINT must be the last attribute, but {_name(attr_type)} follows it")
        if attr_type == FINGERPRINT:
            fingerprint = (offset, value)
        elif MESSAGE_INTEGRITY_SHA256 in kinds:
            pass  # after MESSAGE-INTEGRITY-SHA256 only FINGERPRINT counts
        elif MESSAGE_INTEGRITY in kinds:
            if attr_type == MESSAGE_INTEGRITY_SHA256:  # the one attribute besides FINGERPRINT that counts here
                integrity.append((attr_type, offset, value))
        elif attr_type in _INTEGRITY_TYPES:
            integrity.append((attr_type, offset, value))
        else:
            attributes.append((attr_type, value))
        offset = end
    return attributes, integrity, fingerprint


def _read_attribute(data: bytes, offset: int) -> tuple[int, bytes, int]:
    """Type, value and padded end of the attribute at ``offset``.

    ``parse_header`` made the body a multiple of 4 bytes, so a 4-byte
    attribute header always fits and an in-bounds value's padding does too.
    """
    attr_type, length = struct.unpack_from("!HH", data, offset)
    start = offset + 4
    if start + length > len(data):
        raise StunError(
            f"{_name(attr_type)} at byte {offset} claims {length} bytes but only {len(data) - start} remain"
        )
    return attr_type, data[start : start + length], start + length + (-length % 4)


def _check_fingerprint(data: bytes, offset: int, value: bytes) -> None:
    """StunError unless FINGERPRINT's value is the CRC of everything before it."""
    if len(value) != 4:
        raise StunError(f"FINGERPRINT value is {len(value)} bytes, not 4")
    if int.from_bytes(value) != _fingerprint(data[:offset]):
        raise StunError("FINGERPRINT does not match the message (corrupted, or not STUN)")


def _check_integrity_size(kind: int, value: bytes) -> None:
    """StunError unless an integrity attribute has a legal length (20; or 16-32 in steps of 4 for SHA-256)."""
    if kind == MESSAGE_INTEGRITY and len(value) != 20:
        raise StunError(f"MESSAGE-INTEGRITY value is {len(value)} bytes, not 20")
    if kind == MESSAGE_INTEGRITY_SHA256 and (len(value) % 4 or not 16 <= len(value) <= 32):
        raise StunError(f"MESSAGE-INTEGRITY-SHA256 value is {len(value)} bytes, not a multiple of 4 in 16-32")


def _check_integrity(data: bytes, integrity: list, key: bytes, message: StunMessage) -> None:
    """StunError if no integrity attribute is present; IntegrityError if any fails to match ``key``."""
    if not integrity:
        raise StunError("an integrity key was given but the message has no MESSAGE-INTEGRITY", message)
    for kind, offset, value in integrity:
        if not hmac.compare_digest(_mac(data[:offset], key, kind, len(value)), value):
            raise IntegrityError(f"{_name(kind)} does not match: wrong key or altered message", message)


def _check_values(attributes: list[tuple[int, bytes]]) -> None:
    """StunError if an attribute this module interprets is malformed or repeated."""
    seen: set[int] = set()
    for attr_type, value in attributes:
        check = _VALUE_CHECKS.get(attr_type)
        if check is None:
            continue
        if attr_type in seen:
            raise StunError(f"{_name(attr_type)} appears more than once")
        seen.add(attr_type)
        check(value)


def _parse_address(value: bytes, mask: bytes) -> tuple[str, int]:
    """``(host, port)`` from an address-format value, port and address XORed with ``mask``."""
    if len(value) < 4:
        raise StunError(f"address value is {len(value)} bytes, shorter than its 4-byte head")
    family = value[1]
    size = {0x01: 4, 0x02: 16}.get(family)
    if size is None:
        raise StunError(f"unknown address family {family:#04x} (0x01 is IPv4, 0x02 is IPv6)")
    if len(value) != 4 + size:
        raise StunError(f"address value for family {family:#04x} is {len(value)} bytes, not {4 + size}")
    port = int.from_bytes(value[2:4]) ^ int.from_bytes(mask[:2])
    host = ipaddress.ip_address(bytes(a ^ m for a, m in zip(value[4:], mask)))
    return str(host), port


def _parse_error_code(value: bytes) -> tuple[int, str]:
    """``(code, reason)`` from an ERROR-CODE value: class 3-6, number 0-99, UTF-8 reason."""
    if len(value) < 4:
        raise StunError(f"ERROR-CODE value is {len(value)} bytes, shorter than 4")
    error_class, number = value[2] & 0x07, value[3]
    if not 3 <= error_class <= 6 or number > 99:
        raise StunError(f"ERROR-CODE class {error_class} number {number} is not a code in 300-699")
    return error_class * 100 + number, _parse_text(value[4:], _MAX_TEXT_BYTES, "ERROR-CODE reason")


def _parse_unknown_attributes(value: bytes) -> tuple[int, ...]:
    """The 16-bit types listed in an UNKNOWN-ATTRIBUTES value."""
    if len(value) % 2:
        raise StunError(f"UNKNOWN-ATTRIBUTES value is {len(value)} bytes, not a list of 16-bit types")
    return tuple(int.from_bytes(value[i : i + 2]) for i in range(0, len(value), 2))


def _parse_text(value: bytes, limit: int, what: str) -> str:
    """``value`` as UTF-8 text of at most ``limit`` bytes."""
    if len(value) > limit:
        raise StunError(f"{what} is {len(value)} bytes, over the {limit}-byte limit")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise StunError(f"{what} is not valid UTF-8") from None


def _fixed_size(size: int, what: str) -> Callable[[bytes], None]:
    """A check that a value is exactly ``size`` bytes."""

    def check(value: bytes) -> None:
        if len(value) != size:
            raise StunError(f"{what} value is {len(value)} bytes, not {size}")

    return check


def _address_check(value: bytes) -> None:
    """StunError unless ``value`` is a well-formed address value (XOR or not: the layout is the same)."""
    _parse_address(value, bytes(16))


_VALUE_CHECKS: dict[int, Callable[[bytes], object]] = {
    MAPPED_ADDRESS: _address_check,
    XOR_MAPPED_ADDRESS: _address_check,
    ALTERNATE_SERVER: _address_check,
    RESPONSE_ORIGIN: _address_check,
    OTHER_ADDRESS: _address_check,
    USERNAME: lambda v: _parse_text(v, _MAX_USERNAME_BYTES, "USERNAME"),
    SOFTWARE: lambda v: _parse_text(v, _MAX_TEXT_BYTES, "SOFTWARE"),
    ERROR_CODE: _parse_error_code,
    UNKNOWN_ATTRIBUTES: _parse_unknown_attributes,
    PRIORITY: _fixed_size(4, "PRIORITY"),
    USE_CANDIDATE: _fixed_size(0, "USE-CANDIDATE"),
    ICE_CONTROLLED: _fixed_size(8, "ICE-CONTROLLED"),
    ICE_CONTROLLING: _fixed_size(8, "ICE-CONTROLLING"),
}

_NAMES = {
    MAPPED_ADDRESS: "MAPPED-ADDRESS",
    CHANGE_REQUEST: "CHANGE-REQUEST",
    USERNAME: "USERNAME",
    MESSAGE_INTEGRITY: "MESSAGE-INTEGRITY",
    ERROR_CODE: "ERROR-CODE",
    UNKNOWN_ATTRIBUTES: "UNKNOWN-ATTRIBUTES",
    MESSAGE_INTEGRITY_SHA256: "MESSAGE-INTEGRITY-SHA256",
    XOR_MAPPED_ADDRESS: "XOR-MAPPED-ADDRESS",
    PRIORITY: "PRIORITY",
    USE_CANDIDATE: "USE-CANDIDATE",
    SOFTWARE: "SOFTWARE",
    ALTERNATE_SERVER: "ALTERNATE-SERVER",
    FINGERPRINT: "FINGERPRINT",
    ICE_CONTROLLED: "ICE-CONTROLLED",
    ICE_CONTROLLING: "ICE-CONTROLLING",
    RESPONSE_ORIGIN: "RESPONSE-ORIGIN",
    OTHER_ADDRESS: "OTHER-ADDRESS",
}


def _name(attr_type: int) -> str:
    """A readable name for an attribute type in error messages."""
    return _NAMES.get(attr_type, f"attribute 0x{attr_type:04x}")


# ---------------------------------------------------------------- credentials


def short_term_key(password: str) -> bytes:
    """The HMAC key of the short-term credential mechanism: the UTF-8 of SASLprep(password)."""
    return saslprep(password).encode("utf-8")


def saslprep(text: str) -> str:
    """``text`` prepared by SASLprep (RFC 4013) for a stored string; ValueError if it is not allowed.

    Maps non-ASCII spaces to a space and drops characters "commonly mapped to
    nothing", applies NFKC (Unicode 3.2, as stringprep does), refuses the
    prohibited and unassigned code points, and applies the bidi rule.
    """
    mapped = "".join(" " if stringprep.in_table_c12(ch) else ch for ch in text if not stringprep.in_table_b1(ch))
    prepared = unicodedata.ucd_3_2_0.normalize("NFKC", mapped)
    for ch in prepared:
        if _prohibited(ch):
            raise ValueError(f"U+{ord(ch):04X} is not allowed in a SASLprep string")
    _check_bidi(prepared)
    return prepared


def _prohibited(ch: str) -> bool:
    """Whether SASLprep prohibits ``ch`` (tables C.1.2-C.9, and A.1 unassigned)."""
    return (
        stringprep.in_table_c12(ch)
        or stringprep.in_table_c21_c22(ch)
        or stringprep.in_table_c3(ch)
        or stringprep.in_table_c4(ch)
        or stringprep.in_table_c5(ch)
        or stringprep.in_table_c6(ch)
        or stringprep.in_table_c7(ch)
        or stringprep.in_table_c8(ch)
        or stringprep.in_table_c9(ch)
        or stringprep.in_table_a1(ch)
    )


def _check_bidi(text: str) -> None:
    """ValueError if ``text`` breaks the stringprep bidi rule (RFC 3454 section 6)."""
    if not any(stringprep.in_table_d1(ch) for ch in text):
        return
    if any(stringprep.in_table_d2(ch) for ch in text):
        raise ValueError("a SASLprep string may not mix right-to-left and left-to-right characters")
    if not (stringprep.in_table_d1(text[0]) and stringprep.in_table_d1(text[-1])):
        raise ValueError("a right-to-left SASLprep string must start and end with a right-to-left character")
