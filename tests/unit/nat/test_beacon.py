"""LAN discovery beacons (nat.beacon): the codec and its checks, the schedule, the admission table."""

import random

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from nat.beacon import (BEACON_SIZE, BURST, FRESH, MAX_PEERS, RATE, RETRY, Beacon, LanPeers, decode_beacon,
                        encode_beacon, next_delay)
from nat.errors import Malformed

NOW = 1_800_000_000.0


def keypair():
    private = Ed25519PrivateKey.generate()
    return private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw), private.sign


def test_a_beacon_round_trips_with_its_key_port_and_time():
    key, sign = keypair()
    data = encode_beacon(key, 4100, NOW, sign)
    assert len(data) == BEACON_SIZE == 115
    assert decode_beacon(data, NOW + 1) == Beacon(key, 4100, NOW)


def test_a_beacon_is_refused_if_any_byte_is_changed():
    key, sign = keypair()
    data = encode_beacon(key, 4100, NOW, sign)
    for i in range(len(data)):
        changed = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]
        with pytest.raises(Malformed):
            decode_beacon(changed, NOW)


def test_a_beacon_signed_by_another_key_is_refused():
    key, _ = keypair()
    _, other_sign = keypair()
    with pytest.raises(Malformed, match="signature"):
        decode_beacon(encode_beacon(key, 4100, NOW, other_sign), NOW)


@pytest.mark.parametrize("size", [0, 1, BEACON_SIZE - 1, BEACON_SIZE + 1, 1500])
def test_wrong_sizes_are_refused_before_anything_else(size):
    with pytest.raises(Malformed, match="bytes"):
        decode_beacon(b"\x00" * size, NOW)


def test_stale_or_future_beacons_and_port_zero_are_refused():
    key, sign = keypair()
    for skew in (FRESH + 1, -FRESH - 1):
        with pytest.raises(Malformed, match="from our clock"):
            decode_beacon(encode_beacon(key, 4100, NOW + skew, sign), NOW)
    assert decode_beacon(encode_beacon(key, 4100, NOW - FRESH + 1, sign), NOW).port == 4100
    with pytest.raises(Malformed, match="port 0"):
        decode_beacon(encode_beacon(key, 0, NOW, sign), NOW)


def test_an_invalid_public_key_is_refused_not_raised():
    _, sign = keypair()
    with pytest.raises(Malformed):
        decode_beacon(encode_beacon(b"\xff" * 32, 4100, NOW, sign), NOW)


def test_schedule_doubles_from_one_second_then_keeps_the_interval_with_jitter():
    rng = random.Random(1)
    assert [next_delay(n, 30.0, rng) for n in range(1, 6)] == [1, 2, 4, 8, 16]
    later = [next_delay(n, 30.0, rng) for n in range(6, 50)]
    assert all(27.0 <= d <= 33.0 for d in later) and len(set(later)) > 1


def test_admission_is_a_token_bucket():
    peers = LanPeers()
    assert sum(peers.admit(0.0) for _ in range(BURST * 2)) == BURST  # a burst, then nothing
    assert not peers.admit(0.0)
    assert sum(peers.admit(1.0) for _ in range(BURST * 2)) == RATE  # one second refills RATE tokens
    assert sum(peers.admit(100.0) for _ in range(BURST * 2)) == BURST  # never more than BURST saved up


def test_a_peer_is_dialed_once_per_retry_interval_unless_its_address_changes():
    peers = LanPeers()
    key = b"k" * 32
    assert peers.heard(key, ("10.0.0.2", 4100), 0.0)
    assert not peers.heard(key, ("10.0.0.2", 4100), RETRY - 1)
    assert peers.heard(key, ("10.0.0.2", 4101), RETRY - 1)  # restarted on another port: dial now
    assert not peers.heard(key, ("10.0.0.2", 4101), RETRY)
    assert peers.heard(key, ("10.0.0.2", 4101), 2 * RETRY)


def test_memory_is_bounded_and_the_least_recently_heard_is_forgotten():
    peers = LanPeers(max_peers=3)
    for i in range(3):
        assert peers.heard(bytes([i]) * 32, ("10.0.0.2", 4100 + i), 0.0)
    assert not peers.heard(bytes([0]) * 32, ("10.0.0.2", 4100), 1.0)  # heard again: now the most recent
    assert peers.heard(bytes([9]) * 32, ("10.0.0.9", 4100), 1.0)  # pushes out peer 1
    assert len(peers) == 3
    assert peers.heard(bytes([1]) * 32, ("10.0.0.2", 4101), 2.0)  # forgotten, so dialed again
    assert not peers.heard(bytes([0]) * 32, ("10.0.0.2", 4100), 2.0)
    assert LanPeers().max_peers == MAX_PEERS
