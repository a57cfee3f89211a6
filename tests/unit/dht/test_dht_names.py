"""First-come names (/name/): claims, writers, and which record a replica keeps."""

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dht.names import MAX_WRITERS, Claim, name_key, name_value, parse_name_value, sign_claim
from dht.records import RecordError
from dht.storage import Database, RecordStore
from dht.validators import Validators
from test_dht_records import NOW, Author

KEY = name_key("run42/gpt")


@pytest.fixture
def validators():
    return Validators.default()


def claim_by(owner: Author, *, seq: int = 1, writers=(), key: bytes = KEY) -> Claim:
    return sign_claim(key, owner=owner.public_key, sign=owner.sign, seq=seq,
                      writers=tuple(w.public_key for w in writers))


def named(author: Author, claim: Claim, payload: bytes = b"v1", *, seq: int = 1):
    return author.record(claim.key, name_value(claim, payload), seq=seq)


def test_the_owner_and_the_writers_it_allows_may_write_and_no_one_else(validators):
    owner, writer, stranger = Author(), Author(), Author()
    claim = claim_by(owner, writers=[writer])
    validators.validate(named(owner, claim), NOW)
    validators.validate(named(writer, claim), NOW)
    with pytest.raises(RecordError, match="neither the name's owner nor a writer"):
        validators.validate(named(stranger, claim), NOW)
    assert parse_name_value(named(writer, claim, b"payload").value) == (claim, b"payload")


def test_a_forged_or_misplaced_claim_is_refused(validators):
    owner, forger = Author(), Author()
    claim = claim_by(owner)
    forged = Claim(claim.key, claim.owner, claim.seq, (forger.public_key,), claim.signature)
    with pytest.raises(RecordError, match="signature does not verify"):
        validators.validate(named(forger, forged), NOW)
    elsewhere = claim_by(owner, key=name_key("other"))
    with pytest.raises(RecordError, match="claim is for another key"):
        validators.validate(owner.record(KEY, name_value(elsewhere, b"")), NOW)


@pytest.mark.parametrize("value, message", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb([1, 2, 3]), r"\[claim, payload bytes\]"),
    (msgpack.packb([{"k": KEY}, b""]), "map of k, o, seq, w and sig"),
    (msgpack.packb([{"k": KEY, "o": b"x", "seq": 1, "w": [], "sig": bytes(64)}, b""]), "32-byte owner"),
    (msgpack.packb([{"k": KEY, "o": bytes(32), "seq": -1, "w": [], "sig": bytes(64)}, b""]), "seq"),
    (msgpack.packb([{"k": KEY, "o": bytes(32), "seq": 1, "w": [bytes(32)] * (MAX_WRITERS + 1),
                     "sig": bytes(64)}, b""]), "at most 16 writers"),
])
def test_a_malformed_name_value_is_a_clear_error(value, message):
    with pytest.raises(RecordError, match=message):
        parse_name_value(value)


@given(st.binary(max_size=300))
def test_parsing_any_bytes_either_works_or_is_a_record_error(value):
    try:
        parse_name_value(value)
    except RecordError:
        pass


def test_a_replica_keeps_the_first_owner_and_the_newest_claim_within_it(tmp_path, validators):
    owner, squatter, writer = Author(), Author(), Author()
    store = RecordStore(Database(str(tmp_path / "db")), bytes(32), validators, now=NOW)
    first = named(owner, claim_by(owner, writers=[writer]), seq=1)
    assert store.put(first, NOW)
    assert not store.put(named(squatter, claim_by(squatter), seq=10**12), NOW)  # a later, newer claim
    assert store.get(KEY, NOW) == first

    by_writer = named(writer, claim_by(owner, writers=[writer]), b"v2", seq=2)
    assert store.put(by_writer, NOW)
    revoked = named(owner, claim_by(owner, seq=2), b"v2", seq=2)  # the owner drops the writer
    assert store.put(revoked, NOW)
    # the removed writer's old claim (however new its record) loses to the owner's newer one
    assert not store.put(named(writer, claim_by(owner, writers=[writer]), b"v3", seq=99), NOW)
    assert store.get(KEY, NOW) == revoked


def test_a_reader_takes_the_owner_most_replicas_hold(validators):
    owner, squatter = Author(), Author()
    honest_old = named(owner, claim_by(owner), seq=1)
    honest_new = named(owner, claim_by(owner), b"v2", seq=2)
    squat = named(squatter, claim_by(squatter), seq=10**12)
    assert validators.best([squat, honest_old, honest_new, honest_old]) == honest_new
    assert validators.best([squat, honest_old]) == squat  # a tie goes to the first listed
    assert validators.best([honest_old, squat]) == honest_old
