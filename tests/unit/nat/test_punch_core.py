"""Hole-punching decisions (nat.punch): method, addresses, schedule."""

import pytest

from nat.behaviour import Mapping
from nat.errors import Malformed
from nat.portprobe import HARD
from nat.punch import (
    BURST,
    BURST_GAP,
    DIAL_TIMEOUT,
    MAX_ADDRS,
    TRIES,
    burst,
    choose_method,
    mapping_of,
    parse_addresses,
    public_addresses,
    wait_before_dial,
)

EIM, NO_NAT, UNKNOWN = Mapping.ENDPOINT_INDEPENDENT, Mapping.NO_NAT, Mapping.UNKNOWN


def test_constants_are_the_shells():
    assert (BURST, BURST_GAP, TRIES, DIAL_TIMEOUT, MAX_ADDRS) == (10, 0.02, 3, 3.0, 8)


@pytest.mark.parametrize("hard", sorted(HARD, key=lambda m: m.value))
def test_method_by_mapping_kinds(hard):
    assert choose_method(hard, Mapping.ADDRESS_AND_PORT_DEPENDENT) is None  # both symmetric: nothing works
    assert choose_method(hard, EIM) == choose_method(EIM, hard) == "probe"
    assert choose_method(hard, NO_NAT) == choose_method(NO_NAT, hard) == "punch"  # the hard side dials
    assert choose_method(hard, UNKNOWN) == "punch"  # unknown is not taken as hard


def test_easy_or_unknown_pairs_punch():
    for a in (EIM, NO_NAT, UNKNOWN):
        for b in (EIM, NO_NAT, UNKNOWN):
            assert choose_method(a, b) == "punch"


def test_method_does_not_depend_on_which_side_asks():
    for a in Mapping:
        for b in Mapping:
            assert choose_method(a, b) == choose_method(b, a)


def test_mapping_of_reads_the_reply_and_defaults_to_unknown():
    assert mapping_of({"mapping": "endpoint-independent"}) is EIM
    assert mapping_of({"mapping": "no NAT", "addrs": []}) is NO_NAT
    for reply in (None, [], {}, {"mapping": "cone"}, {"mapping": 3}, {"mapping": ["no NAT"]}):
        assert mapping_of(reply) is UNKNOWN


def test_parse_addresses_returns_the_texts_capped():
    texts = [f"203.0.113.{i}:4100" for i in range(12)]
    assert parse_addresses({"addrs": texts}) == texts[:MAX_ADDRS]
    assert parse_addresses({"addrs": texts[:8] + [None]}) == texts[:8]  # past the cap is not read
    assert parse_addresses({"addrs": [], "mapping": "no NAT"}) == []


@pytest.mark.parametrize("arg", [None, {}, {"addrs": "a:1"}, {"addrs": ["a:1", 5]}, {"addrs": [None]}])
def test_parse_addresses_refuses_other_shapes(arg):
    with pytest.raises(Malformed) as caught:
        parse_addresses(arg)
    assert caught.value.kind == "malformed"


def test_public_addresses_put_the_port_mapping_first_then_stun_then_listen():
    got = public_addresses("198.51.100.7:4100", ["203.0.113.5:4100", "198.51.100.7:4100", "203.0.113.5:4100"],
                           "10.0.0.2:4100")
    assert got == ["198.51.100.7:4100", "203.0.113.5:4100", "10.0.0.2:4100"]
    assert public_addresses(None, ["203.0.113.5:4100"], "10.0.0.2:4100") == ["203.0.113.5:4100", "10.0.0.2:4100"]


def test_public_addresses_leave_out_a_wildcard_listen_address():
    assert public_addresses(None, ["203.0.113.5:4100"], "0.0.0.0:4100") == ["203.0.113.5:4100"]
    assert public_addresses(None, [], "[::]:4100") == []
    assert public_addresses(None, [], "[2001:db8::1]:4100") == ["[2001:db8::1]:4100"]


def test_public_addresses_are_capped():
    reflexive = [f"203.0.113.{i}:1" for i in range(20)]
    got = public_addresses("198.51.100.1:1", reflexive, "10.0.0.2:1")
    assert len(got) == MAX_ADDRS and got[0] == "198.51.100.1:1" and "10.0.0.2:1" not in got


def test_burst_sends_to_every_target_each_round_then_pauses():
    schedule = burst([("a", 1), ("b", 2)])
    assert len(schedule) == BURST
    assert all(targets == [("a", 1), ("b", 2)] and pause == BURST_GAP for targets, pause in schedule)
    assert sum(len(targets) for targets, _ in schedule) == BURST * 2
    assert burst(["x"], count=2, gap=0.5) == [(["x"], 0.5), (["x"], 0.5)]
    assert burst([]) == [([], BURST_GAP)] * BURST  # the pacing holds with nothing resolved


def test_rounds_are_independent_lists():
    schedule = burst(["a"], count=2)
    schedule[0][0].append("b")
    assert schedule[1][0] == ["a"]


def test_the_asker_waits_half_the_round_trip():
    assert wait_before_dial(exchange_started=10.0, answered=10.3) == pytest.approx(0.15)
    assert wait_before_dial(5.0, 5.0) == 0.0
