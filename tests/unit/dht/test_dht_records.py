"""Signed DHT records: wire format, signatures, expiry and namespace rules."""

import dataclasses
import itertools

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from dht.records import (
    CLOCK_SKEW,
    MAX_KEY,
    MAX_TTL,
    MAX_VALUE,
    OpenValidator,
    Record,
    RecordError,
    namespace_of,
    owned_key,
    sign_record,
    signed_by,
)
from dht.validators import Validators

NOW = 1_700_000_000


class Author:
    """A test identity: an Ed25519 key pair that signs records."""

    def __init__(self) -> None:
        self._private = Ed25519PrivateKey.generate()
        self.public_key = self._private.public_key().public_bytes_raw()

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)

    def record(self, key: bytes, value: bytes = b"value", *, seq: int = 0, expires: int = NOW + 3600) -> Record:
        return sign_record(key, value, public_key=self.public_key, sign=self.sign, seq=seq, expires=expires)


@pytest.fixture
def author() -> Author:
    return Author()


@pytest.fixture
def validators() -> Validators:
    return Validators.default()


def test_signed_record_round_trips_through_msgpack(author, validators):
    record = author.record(b"/open/model", b"weights-v1", seq=3)
    assert record.verify_signature()
    wire = msgpack.unpackb(msgpack.packb(record.to_wire()))
    assert set(wire) == {"k", "v", "pk", "seq", "exp", "sig"}
    parsed = Record.from_wire(wire)
    assert parsed == record
    validators.validate(parsed, NOW)


def test_encoded_size_counts_key_value_and_overhead(author):
    record = author.record(b"/open/k", b"x" * 100)
    assert record.encoded_size == len(b"/open/k") + 100 + 32 + 64 + 16


def _valid_wire() -> dict:
    return Author().record(b"/open/k").to_wire()


@pytest.mark.parametrize(
    "field, bad",
    [
        ("k", "/open/k"),
        ("k", b""),
        ("k", b"/open/" + b"x" * MAX_KEY),
        ("v", "text"),
        ("v", b"x" * (MAX_VALUE + 1)),
        ("pk", b"x" * 31),
        ("pk", None),
        ("seq", -1),
        ("seq", 2**63),
        ("seq", True),
        ("seq", 1.0),
        ("exp", "soon"),
        ("exp", -5),
        ("sig", b"x" * 63),
        ("sig", [1, 2]),
    ],
)
def test_from_wire_rejects_bad_field(field, bad):
    wire = _valid_wire()
    wire[field] = bad
    with pytest.raises(RecordError, match="a record's"):
        Record.from_wire(wire)


def test_from_wire_rejects_non_map_and_missing_fields():
    with pytest.raises(RecordError, match="must be a map"):
        Record.from_wire([b"/open/k", b"v"])
    wire = _valid_wire()
    del wire["sig"], wire["exp"]
    with pytest.raises(RecordError, match="missing fields: exp, sig"):
        Record.from_wire(wire)


def test_from_wire_ignores_unknown_fields():
    wire = _valid_wire()
    assert Record.from_wire({**wire, "future": 1}) == Record.from_wire(wire)


_peer_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.binary(max_size=300) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=10,
)
_field_names = st.sampled_from(["k", "v", "pk", "seq", "exp", "sig"])


@given(st.dictionaries(_field_names | st.text(max_size=4), _peer_values) | _peer_values)
def test_from_wire_only_raises_record_error_on_arbitrary_input(obj):
    try:
        Record.from_wire(obj)
    except RecordError:
        pass


@given(
    st.fixed_dictionaries(
        {
            "k": st.binary(max_size=MAX_KEY + 2),
            "v": st.binary(max_size=64) | st.text(max_size=4),
            "pk": st.binary(min_size=30, max_size=34),
            "seq": st.integers(min_value=-2, max_value=2**64),
            "exp": st.integers(min_value=-2, max_value=2**64) | st.floats(),
            "sig": st.binary(min_size=62, max_size=66),
        }
    )
)
def test_from_wire_parses_or_rejects_nearly_valid_maps(obj):
    try:
        record = Record.from_wire(obj)
    except RecordError:
        return
    assert record.to_wire() == obj


def test_sign_record_rejects_a_signer_returning_garbage(author):
    with pytest.raises(RecordError, match="signature must be 64 bytes"):
        sign_record(b"/open/k", b"v", public_key=author.public_key, sign=lambda data: b"sig", seq=0, expires=NOW)


def test_record_claiming_another_author_is_rejected(author, validators):
    victim = Author()
    forged = sign_record(b"/open/k", b"v", public_key=victim.public_key, sign=author.sign, seq=0, expires=NOW + 60)
    assert not forged.verify_signature()
    with pytest.raises(RecordError, match="signature does not verify"):
        validators.validate(forged, NOW)


@pytest.mark.parametrize(
    "change", [{"value": b"tampered"}, {"seq": 99}, {"expires": NOW + 7200}, {"key": b"/open/j"}]
)
def test_tampered_record_is_rejected(author, validators, change):
    tampered = dataclasses.replace(author.record(b"/open/k"), **change)
    with pytest.raises(RecordError, match="signature does not verify"):
        validators.validate(tampered, NOW)


def test_invalid_public_key_bytes_fail_verification_without_crashing(author):
    record = dataclasses.replace(author.record(b"/open/k"), public_key=b"\xff" * 32)
    assert not record.verify_signature()


def test_expiry_window(author, validators):
    validators.validate(author.record(b"/open/k", expires=NOW + 1), NOW)
    validators.validate(author.record(b"/open/k", expires=NOW + MAX_TTL + CLOCK_SKEW), NOW)
    with pytest.raises(RecordError, match="expired"):
        validators.validate(author.record(b"/open/k", expires=NOW), NOW)
    with pytest.raises(RecordError, match="expires more than"):
        validators.validate(author.record(b"/open/k", expires=NOW + MAX_TTL + CLOCK_SKEW + 1), NOW)


def test_owned_key_accepts_only_its_owner(author, validators):
    key = owned_key(author.public_key, b"profile")
    assert key == b"/owned/" + author.public_key.hex().encode() + b"/profile"
    validators.validate(author.record(key), NOW)
    with pytest.raises(RecordError, match="only the public key named"):
        validators.validate(Author().record(key), NOW)


@pytest.mark.parametrize(
    "make_key",
    [
        lambda pk: b"/owned/" + pk.hex().encode(),
        lambda pk: b"/owned/" + pk.hex().encode() + b"/",
        lambda pk: b"/owned/" + pk.hex().upper().encode() + b"/name",
        lambda pk: b"/owned/name",
    ],
    ids=["no name", "empty name", "upper-case hex", "no owner"],
)
def test_malformed_owned_key_is_rejected(author, validators, make_key):
    with pytest.raises(RecordError, match="/owned/ key"):
        validators.validate(author.record(make_key(author.public_key)), NOW)


def test_owned_key_helper_checks_its_arguments(author):
    with pytest.raises(RecordError, match="non-empty name"):
        owned_key(author.public_key, b"")
    with pytest.raises(RecordError, match="public key must be 32 bytes"):
        owned_key(b"short", b"name")


def test_namespaces(author, validators):
    assert namespace_of(b"/open/a/b") == b"open"
    for key in [b"open/a", b"/open", b"/open/", b"//a"]:
        with pytest.raises(RecordError, match="key must look like /namespace/name"):
            namespace_of(key)
    with pytest.raises(RecordError, match=r"unknown namespace b'models'; known: /name/, /open/, /owned/"):
        validators.validate(author.record(b"/models/llama"), NOW)


def test_registered_namespace_applies_its_rules(author):
    class ReadOnly(OpenValidator):
        def validate(self, record, now):
            raise RecordError("read-only namespace")

    validators = Validators.default()
    validators.register(b"frozen", ReadOnly())
    with pytest.raises(RecordError, match="read-only"):
        validators.validate(author.record(b"/frozen/x"), NOW)
    with pytest.raises(ValueError, match="already has a validator"):
        validators.register(b"open", OpenValidator())
    with pytest.raises(ValueError, match="without '/'"):
        validators.register(b"a/b", OpenValidator())


def test_best_prefers_higher_seq_then_later_expiry(author, validators):
    low = author.record(b"/open/k", seq=1, expires=NOW + 9000)
    high = author.record(b"/open/k", seq=2, expires=NOW + 60)
    later = author.record(b"/open/k", seq=2, expires=NOW + 120)
    assert validators.better(high, low) and not validators.better(low, high)
    assert validators.better(later, high)
    assert not validators.better(later, later)
    assert validators.best([low, later, high]) == later


def test_best_tie_break_is_the_same_in_every_order(validators):
    ties = [Author().record(b"/open/k", b"value %d" % i, seq=5) for i in range(4)]
    winner = max(ties, key=lambda record: record.signature)
    assert {validators.best(list(order)) for order in itertools.permutations(ties)} == {winner}


def test_best_and_better_refuse_nonsense(author, validators):
    with pytest.raises(ValueError, match="at least one"):
        validators.best([])
    with pytest.raises(ValueError, match="same key"):
        validators.better(author.record(b"/open/a"), author.record(b"/open/b"))


def test_signed_by_refuses_a_short_signature_whose_tail_starts_the_data(author):
    """libsodium checks signature and data as one string: the signature's length is checked first."""
    sig = author.sign(b"signed")
    assert signed_by(author.public_key, sig, b"signed")
    assert not signed_by(author.public_key, sig[:-1], sig[-1:] + b"signed")
    assert not signed_by(author.public_key[:31], sig, b"signed")  # a short key is refused, not raised
