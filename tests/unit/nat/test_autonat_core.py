"""AutoNAT decisions (nat.autonat): admission, helpers, dial-back rules and the verdict."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nat.autonat import (
    FILTERING,
    MAX_EXCLUDED,
    MAX_HELPERS,
    RECENT_CONTACT,
    REQUEST_INTERVAL,
    VERDICT_TRIES,
    PerPeerInterval,
    Verdict,
    backoff_delays,
    choose_helpers,
    contacted,
    dial_back_check,
    parse_dial_back,
    parse_exclude,
    reachable_of,
)
from nat.errors import Malformed, Refused

SETTINGS = settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_constants_are_the_shells():
    assert (REQUEST_INTERVAL, MAX_HELPERS, MAX_EXCLUDED, RECENT_CONTACT, VERDICT_TRIES) == (10.0, 3, 256, 180.0, 8)


# --- one request per interval ----------------------------------------------------


def test_a_second_request_within_the_interval_is_too_soon():
    limit = PerPeerInterval(REQUEST_INTERVAL, "AutoNAT request")
    limit.admit("n", 100.0)
    with pytest.raises(Refused) as caught:
        limit.admit("n", 109.9)
    assert caught.value.kind == "too_soon"
    assert str(caught.value) == "one AutoNAT request per 10 s"
    limit.admit("n", 110.0)  # exactly one interval later is allowed
    limit.admit("m", 110.0)  # other peers have their own budget


def test_check_alone_does_not_count_a_request():
    limit = PerPeerInterval(10.0)
    limit.check("n", 0.0)
    limit.check("n", 1.0)  # nothing recorded: a request that made no dial costs nothing
    limit.record("n", 1.0)
    with pytest.raises(Refused):
        limit.check("n", 2.0)


def test_a_refused_request_does_not_restart_the_interval():
    limit = PerPeerInterval(10.0)
    limit.admit("n", 0.0)
    with pytest.raises(Refused):
        limit.admit("n", 9.0)
    limit.admit("n", 10.0)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 8), st.booleans()), max_size=50))
def test_per_peer_interval_refuses_exactly_when_the_last_recorded_request_is_too_recent(steps):
    limit, last, now = PerPeerInterval(10.0), {}, 0.0
    for peer, step, record in steps:
        now += step
        too_soon = peer in last and now - last[peer] < 10.0
        if too_soon:
            with pytest.raises(Refused):
                limit.check(peer, now)
        else:
            limit.check(peer, now)
            if record:
                limit.record(peer, now)
                last[peer] = now


# --- the asked node: who may dial back --------------------------------------------


def test_parse_exclude_reads_the_list_and_caps_it():
    assert parse_exclude(None) == set() and parse_exclude({}) == set()
    assert parse_exclude({"exclude": ["a", "b", "a"]}) == {"a", "b"}
    many = [f"p{i}" for i in range(MAX_EXCLUDED + 10)]
    assert parse_exclude({"exclude": many}) == set(many[:MAX_EXCLUDED])
    assert parse_exclude({"exclude": many + [7]}) == set(many[:MAX_EXCLUDED])  # past the cap is not read


@pytest.mark.parametrize("arg", [{"exclude": "a"}, {"exclude": None}, {"exclude": ["a", 1]}, {"exclude": [["a"]]}])
def test_parse_exclude_refuses_a_malformed_list(arg):
    with pytest.raises(Malformed) as caught:
        parse_exclude(arg)
    assert caught.value.kind == "malformed"


def test_helpers_are_never_the_requester_nor_excluded_and_at_most_three():
    connected = ["req", "a", "b", "c", "d", "e"]
    helpers = choose_helpers(connected, "req", {"b", "zzz"}, random.Random(1))
    assert len(helpers) == MAX_HELPERS
    assert set(helpers) <= {"a", "c", "d", "e"}
    assert choose_helpers(["req", "a"], "req", set(), random.Random(1)) == ["a"]
    assert choose_helpers(["req"], "req", set(), random.Random(1)) == []


def test_helpers_are_excluded_by_their_text_not_the_object():
    class Peer:
        def __init__(self, name):
            self.name = name

        def __str__(self):
            return self.name

    a, b = Peer("a"), Peer("b")
    assert choose_helpers([a, b], object(), {"a"}, random.Random(0)) == [b]


def test_helper_choice_comes_from_the_injected_rng_and_reaches_every_peer():
    connected = [f"p{i}" for i in range(10)]
    assert choose_helpers(connected, "x", set(), random.Random(7)) == choose_helpers(connected, "x", set(), random.Random(7))
    chosen = set()
    rng = random.Random(3)
    for _ in range(200):
        chosen.update(choose_helpers(connected, "x", set(), rng))
    assert chosen == set(connected)


@SETTINGS
@given(st.lists(st.integers(0, 20), unique=True, max_size=15), st.integers(0, 20),
       st.sets(st.integers(0, 20)), st.integers(0, 2**32))
def test_helpers_are_distinct_eligible_peers_as_many_as_allowed(connected, requester, excluded, seed):
    excluded_text = {str(e) for e in excluded}
    helpers = choose_helpers(connected, requester, excluded_text, random.Random(seed))
    eligible = [p for p in connected if p != requester and str(p) not in excluded_text]
    assert len(set(helpers)) == len(helpers) == min(MAX_HELPERS, len(eligible))
    assert set(helpers) <= set(eligible)


def test_a_helpers_answer_counts_only_when_well_formed():
    assert reachable_of({"reachable": True}) is True
    assert reachable_of({"reachable": False}) is False
    for bad in (None, {}, {"reachable": 1}, {"reachable": "yes"}, [True]):
        assert reachable_of(bad) is None


# --- the helper: is a dial-back worth anything ---------------------------------------


def test_parse_dial_back_returns_peer_and_address_texts():
    assert parse_dial_back({"peer": "P", "addr": "203.0.113.5:4100"}) == ("P", "203.0.113.5:4100")


@pytest.mark.parametrize("arg", [None, {}, {"peer": "P"}, {"addr": "h:1"}, {"peer": 1, "addr": "h:1"},
                                 {"peer": "P", "addr": ["h", 1]}])
def test_parse_dial_back_refuses_other_shapes(arg):
    with pytest.raises(Malformed):
        parse_dial_back(arg)


def test_a_dial_back_is_pointless_when_the_targets_nat_would_let_us_in_anyway():
    dial_back_check(target_connected=False, talked_recently=False)
    for connected, talked, words in [(True, False, "already connected"), (False, True, "exchanged packets"),
                                     (True, True, "already connected")]:
        with pytest.raises(Refused) as caught:
            dial_back_check(connected, talked)
        assert caught.value.kind == "pointless" and words in str(caught.value)


# --- the asking node ------------------------------------------------------------------


def test_contacted_lists_recent_dials_then_connections_once_each():
    dialed = {"old": 0.0, "a": 900.0, "edge": 1000.0 - RECENT_CONTACT, "b": 999.0}
    assert contacted(dialed, ["c", "a"], now=1000.0) == ["a", "b", "c"]


def test_contacted_is_text_and_capped():
    dialed = {i: 0.0 for i in range(MAX_EXCLUDED)}
    names = contacted(dialed, ["late"], now=1.0)
    assert len(names) == MAX_EXCLUDED and names[0] == "0" and "late" not in names


def test_backoff_doubles_from_one_second_to_a_minute():
    assert backoff_delays() == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert len(backoff_delays()) == VERDICT_TRIES


def test_verdict_starts_unknown():
    verdict = Verdict()
    assert (verdict.status, verdict.address, verdict.via, verdict.filtering) == ("unknown", None, None, None)


def test_verdict_reports_a_change_of_status_only():
    verdict = Verdict()
    assert verdict.apply({"reachable": True, "address": "203.0.113.5:4100", "via": "B"}) is True
    assert (verdict.status, verdict.address, verdict.via) == ("public", "203.0.113.5:4100", "B")
    assert verdict.filtering == FILTERING["public"] == "endpoint-independent (strangers reach us)"
    assert verdict.apply({"reachable": True, "address": "203.0.113.5:4101", "via": "C"}) is False
    assert (verdict.address, verdict.via) == ("203.0.113.5:4101", "C")  # kept current all the same
    assert verdict.apply({"reachable": False, "address": "203.0.113.5:4101", "via": "C"}) is True
    assert verdict.status == "private" and verdict.filtering == "address-dependent or stricter"


@pytest.mark.parametrize("reply", [None, "public", {}, {"reachable": "yes", "address": "a:1", "via": "B"},
                                   {"reachable": True}, {"reachable": True, "address": None, "via": "B"},
                                   {"reachable": True, "address": "a:1", "via": 3}])
def test_a_malformed_verdict_changes_nothing(reply):
    verdict = Verdict()
    verdict.apply({"reachable": False, "address": "a:1", "via": "B"})
    assert verdict.apply(reply) is None
    assert (verdict.status, verdict.address, verdict.via) == ("private", "a:1", "B")
