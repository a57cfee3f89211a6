"""Identity keys on disk, PeerId text form, peer addresses."""

import os
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given, strategies as st

from meshd.address import AddressError, HostPort, PeerAddr
from meshd.identity import (
    Identity,
    IdentityError,
    PeerId,
    PeerIdError,
    create_identity,
    load_identity,
    load_or_create_identity,
)


def test_key_is_created_0600_and_reloaded(tmp_path):
    created = create_identity(tmp_path)
    assert stat.S_IMODE((tmp_path / "identity.key").stat().st_mode) == 0o600
    assert load_identity(tmp_path).peer_id == created.peer_id
    assert load_or_create_identity(tmp_path).peer_id == created.peer_id


def test_existing_key_is_never_overwritten(tmp_path):
    create_identity(tmp_path)
    with pytest.raises(IdentityError, match="refusing to overwrite"):
        create_identity(tmp_path)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_key_readable_by_others_is_refused(tmp_path, mode):
    create_identity(tmp_path)
    os.chmod(tmp_path / "identity.key", mode)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_identity(tmp_path)


def test_missing_garbled_and_foreign_keys_say_so_and_what_to_do(tmp_path):
    with pytest.raises(IdentityError, match="meshd init"):
        load_identity(tmp_path)
    path = tmp_path / "identity.key"
    path.write_text("not a key")
    os.chmod(path, 0o600)
    fix = "restore the key from a backup, or move it aside to start as a new identity"
    with pytest.raises(IdentityError, match=f"not a PEM private key .*; {fix}"):
        load_identity(tmp_path)
    path.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    with pytest.raises(IdentityError, match=f"not an Ed25519 key; {fix}"):
        load_identity(tmp_path)
    path.write_bytes(Identity.generate().private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret")))
    with pytest.raises(IdentityError, match="encrypted with a password; meshd needs it unencrypted"):
        load_identity(tmp_path)


@given(st.binary(min_size=32, max_size=32))
def test_peer_id_text_round_trip(key):
    peer = PeerId(key)
    text = str(peer)
    assert len(text) == 56 and text == text.lower()
    assert PeerId.from_string(text) == peer


def test_peer_id_errors_name_the_problem():
    text = str(Identity.generate().peer_id)
    with pytest.raises(PeerIdError, match="56 characters"):
        PeerId.from_string(text[:-1])
    with pytest.raises(PeerIdError, match="a-z and 2-7"):
        PeerId.from_string(text[:-1] + "!")
    flipped = text[:5] + ("a" if text[5] != "a" else "b") + text[6:]
    with pytest.raises(PeerIdError, match="checksum"):
        PeerId.from_string(flipped)


def test_signatures_verify_only_for_the_signer():
    alice, bob = Identity.generate(), Identity.generate()
    sig = alice.sign(b"hello")
    assert alice.peer_id.verify(sig, b"hello")
    assert not alice.peer_id.verify(sig, b"hellO")
    assert not bob.peer_id.verify(sig, b"hello")


@pytest.mark.parametrize("cut", [1, 8, 63])
def test_a_short_signature_is_refused_not_read_on_into_the_data(cut):
    """libsodium checks signature and data as one string: a signature cut short, with
    its tail moved to the front of the data, must not pass for the data after it."""
    alice = Identity.generate()
    sig = alice.sign(b"signed")
    assert alice.peer_id.verify(sig, b"signed")
    assert not alice.peer_id.verify(sig[:-cut], sig[-cut:] + b"signed")
    assert not alice.peer_id.verify(sig + b"s", b"igned")


@given(
    st.binary(min_size=32, max_size=32),
    st.one_of(
        st.ip_addresses(v=4).map(str),
        st.ip_addresses(v=6).map(str),
        st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z]{2,5})?", fullmatch=True),
    ),
    st.integers(1, 65535),
)
def test_peer_address_round_trip(key, host, port):
    addr = PeerAddr(PeerId(key), HostPort(host, port))
    assert PeerAddr.parse(str(addr)) == addr


@pytest.mark.parametrize(
    "text, reason",
    [
        ("127.0.0.1:4100", "PEERID@HOST:PORT"),
        ("{pid}@127.0.0.1", "HOST:PORT"),
        ("{pid}@127.0.0.1:http", "not a number"),
        ("{pid}@127.0.0.1:70000", "outside"),
        ("{pid}@::1:4100", "brackets"),
        ("{pid}@[::1:4100", "closing"),
        ("{pid}@[nothost]:4100", "not an IPv6"),
        ("abc@127.0.0.1:4100", "bad PeerId"),
    ],
)
def test_address_parse_errors_say_what_is_wrong(text, reason):
    pid = str(Identity.generate().peer_id)
    with pytest.raises(AddressError, match=reason):
        PeerAddr.parse(text.format(pid=pid))
