"""Port-prediction probing decisions (nat.portprobe): roles, admission, schedule, odds."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nat.behaviour import Mapping
from nat.errors import Malformed, Refused
from nat.portprobe import (
    ASK_INTERVAL,
    DIAL_TIMEOUT,
    EASY,
    EASY_PROBES,
    HARD,
    HARD_PORTS,
    HIT_WAIT,
    PROBE_BATCH,
    PROBE_GAP,
    ProbeAdmission,
    hit_probability,
    parse_open_ports,
    parse_probe,
    probe_batches,
    probe_ports,
    relayed_only,
    role,
)

SETTINGS = settings(max_examples=100, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_constants_are_the_shells():
    assert (HARD_PORTS, EASY_PROBES, PROBE_BATCH, PROBE_GAP) == (256, 2048, 64, 0.005)
    assert (HIT_WAIT, DIAL_TIMEOUT, ASK_INTERVAL) == (5.0, 5.0, 30.0)
    assert EASY == {Mapping.NO_NAT, Mapping.ENDPOINT_INDEPENDENT}
    assert HARD == {Mapping.ENDPOINT_DEPENDENT, Mapping.ADDRESS_DEPENDENT, Mapping.ADDRESS_AND_PORT_DEPENDENT}


def test_roles_pair_one_hard_side_with_one_easy_side():
    for hard in HARD:
        for easy in EASY:
            assert role(hard, easy) == "hard"
            assert role(easy, hard) == "easy"
    for a, b in [(x, y) for x in HARD for y in HARD] + [(x, y) for x in EASY for y in EASY]:
        assert role(a, b) is None, (a, b)  # both hard: hopeless; both easy: plain punching does it


def test_unknown_mapping_takes_no_role():
    assert role(Mapping.UNKNOWN, Mapping.ENDPOINT_DEPENDENT) is None
    assert role(Mapping.NO_NAT, Mapping.UNKNOWN) is None


def test_only_relayed_peers_may_ask():
    relayed_only("relayed", "hole punching")
    for path in ("direct", "punched", None):
        with pytest.raises(Refused) as caught:
            relayed_only(path, "hole punching")
        assert caught.value.kind == "not_relayed"
        assert str(caught.value) == "hole punching is asked for over a relayed connection"


def test_admission_is_relayed_only_and_once_per_interval_per_peer():
    admission = ProbeAdmission()
    with pytest.raises(Refused) as caught:
        admission.admit("x", "direct", 0.0)
    assert caught.value.kind == "not_relayed" and "port probing" in str(caught.value)
    admission.admit("x", "relayed", 0.0)  # the refused direct request was not counted
    with pytest.raises(Refused) as caught:
        admission.admit("x", "relayed", ASK_INTERVAL - 0.1)
    assert caught.value.kind == "too_soon" and str(caught.value) == "one port-probing request per 30 s"
    admission.admit("y", "relayed", 1.0)
    admission.admit("x", "relayed", ASK_INTERVAL)


def test_parse_open_ports_and_probe_requests():
    assert parse_open_ports({"addr": "203.0.113.5:4100"}) == "203.0.113.5:4100"
    assert parse_probe({"ip": "203.0.113.9"}) == "203.0.113.9"
    for bad in (None, {}, {"addr": 4100}, {"ip": "x"}):
        with pytest.raises(Malformed):
            parse_open_ports(bad)
    for bad in (None, {}, {"ip": 7}, {"addr": "x:1"}):
        with pytest.raises(Malformed):
            parse_probe(bad)


def test_probe_ports_are_distinct_unprivileged_and_from_the_injected_rng():
    ports = probe_ports(random.Random(5))
    assert len(ports) == EASY_PROBES == len(set(ports))
    assert all(1024 <= p <= 65535 for p in ports)
    assert ports == random.Random(5).sample(range(1024, 65536), EASY_PROBES)
    assert ports != probe_ports(random.Random(6))
    assert len(probe_ports(random.Random(0), count=10)) == 10
    assert sorted(probe_ports(random.Random(0), count=64512)) == list(range(1024, 65536))  # every port can be hit


def test_probe_schedule_pauses_after_every_full_batch():
    ports = list(range(EASY_PROBES))
    schedule = probe_batches(ports)
    assert len(schedule) == EASY_PROBES // PROBE_BATCH == 32
    assert all(len(batch) == PROBE_BATCH and pause == PROBE_GAP for batch, pause in schedule)
    assert [p for batch, _ in schedule for p in batch] == ports


@SETTINGS
@given(st.lists(st.integers(1024, 65535), max_size=300), st.integers(1, 100))
def test_probe_schedule_keeps_order_and_pauses_only_after_full_batches(ports, size):
    schedule = probe_batches(ports, batch=size, gap=0.1)
    assert [p for batch, _ in schedule for p in batch] == ports
    sent = 0
    for batch, pause in schedule:
        sent += len(batch)
        assert 0 < len(batch) <= size
        assert pause == (0.1 if sent % size == 0 else 0.0)  # as the shell's `i % PROBE_BATCH == 0`


def test_the_default_odds_are_about_three_in_ten_thousand_to_miss():
    assert hit_probability() == pytest.approx(0.99971, abs=1e-5)
    assert hit_probability(HARD_PORTS, 0) == 0.0
    assert hit_probability(64512, 1) == 1.0
    assert hit_probability(probes=1024) < hit_probability(probes=2048)
    assert hit_probability(hard_ports=128) < hit_probability()


def test_the_odds_match_a_simulation_of_probes_landing_on_open_mappings():
    rng = random.Random(11)
    hard_ports, probes, trials = 64, 128, 2000
    hits = 0
    for _ in range(trials):
        open_ports = set(rng.sample(range(1024, 65536), hard_ports))
        hits += any(p in open_ports for p in probe_ports(rng, probes))
    assert hits / trials == pytest.approx(hit_probability(hard_ports, probes), abs=0.03)
