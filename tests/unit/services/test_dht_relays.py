"""Decoding a peer's relays record (peer data: any bytes the DHT hands over)."""

from hypothesis import given, strategies as st

from meshd.address import PeerAddr
from meshd.identity import Identity
from meshd.services.dht.relays import MAX_RELAYS, decode_relays, relays_key
from meshd.wire import pack

RELAYS = [f"{Identity.generate().peer_id}@10.0.0.{i}:4100" for i in range(MAX_RELAYS + 2)]


def test_a_record_names_at_most_eight_relays_and_its_bad_entries_are_skipped():
    assert decode_relays(pack(RELAYS)) == [PeerAddr.parse(text) for text in RELAYS[:MAX_RELAYS]]
    value = pack([RELAYS[0], "not an address", 7, b"bytes", "nobody@10.0.0.9:1", *RELAYS[1:]])
    # the first eight entries are looked at, the four that are addresses kept
    assert decode_relays(value) == [PeerAddr.parse(text) for text in RELAYS[:4]]


def test_a_value_that_is_not_a_list_names_no_relay():
    for value in (b"", b"\xc1", pack({"relays": RELAYS}), pack(RELAYS[0])):
        assert decode_relays(value) == []


@given(st.binary(max_size=512) | st.lists(st.one_of(st.text(max_size=80), st.integers(-(2 ** 63), 2 ** 64 - 1), st.binary(max_size=8)),
                                           max_size=20).map(pack))
def test_any_value_decodes_to_a_bounded_list_of_addresses(value):
    decoded = decode_relays(value)
    assert len(decoded) <= MAX_RELAYS and all(isinstance(a, PeerAddr) for a in decoded)


def test_the_record_lives_under_the_peers_own_owned_key():
    peer = Identity.generate().peer_id
    assert relays_key(peer) == b"/owned/" + peer.key.hex().encode() + b"/relays"
