"""Relay reservations and circuit limits (nat.relay), with no sockets and no clock."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nat.errors import Malformed, NatError, Refused
from nat.relay import ByteBudget, HeldReservations, Pacer, RelayLimits, Reservations, parse_limits, renew_after

SETTINGS = settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIMITS = RelayLimits(enabled=True, max_reservations=2, reservation_ttl=100.0, max_circuits=2,
                     circuit_bytes=1000, circuit_seconds=30.0)


def refusal(kind, call, *args, **kwargs):
    with pytest.raises(Refused) as caught:
        call(*args, **kwargs)
    assert caught.value.kind == kind
    return caught.value


def test_defaults_match_the_relay_config_section():
    limits = RelayLimits()
    assert (limits.enabled, limits.max_reservations, limits.reservation_ttl) == (False, 128, 3600.0)
    assert (limits.max_circuits, limits.circuit_bytes, limits.circuit_seconds) == (16, 128 << 20, 600.0)


def test_reserve_answers_with_the_limits_in_wire_form():
    table = Reservations(LIMITS)
    assert table.reserve("n", now=0.0) == {"ttl": 100.0, "max_circuits": 2, "circuit_bytes": 1000,
                                           "circuit_seconds": 30.0}
    assert "n" in table and list(table) == ["n"] and len(table) == 1


def test_a_relay_with_relaying_off_refuses_every_reservation():
    table = Reservations(RelayLimits())
    exc = refusal("disabled", table.reserve, "n", 0.0)
    assert "does not relay" in str(exc)
    assert "n" not in table


def test_a_full_relay_refuses_newcomers_but_renews_holders():
    table = Reservations(LIMITS)
    table.reserve("a", 0.0)
    table.reserve("b", 0.0)
    exc = refusal("full", table.reserve, "c", 10.0)
    assert "2 reservations" in str(exc)
    table.reserve("a", 10.0)  # a holder renews even when full
    assert table.status(10.0)["a"]["expires_in"] == 100


def test_expired_reservations_free_their_slot_at_the_exact_expiry():
    table = Reservations(LIMITS)
    table.reserve("a", 0.0)
    table.reserve("b", 50.0)
    refusal("full", table.reserve, "c", 99.9)
    table.reserve("c", 100.0)  # a's lifetime ended at 100.0 (expires <= now)
    assert set(table) == {"b", "c"}


def test_renewal_extends_the_lifetime_and_keeps_open_circuits():
    table = Reservations(LIMITS)
    table.reserve("n", 0.0)
    table.open_circuit("n", 1.0, connected=True)
    table.reserve("n", 60.0)
    assert table.status(60.0) == {"n": {"circuits": 1, "expires_in": 100}}
    assert table.status(150.0)["n"]["expires_in"] == 10


def test_status_rounds_seconds_left_and_hides_expired_reservations():
    table = Reservations(LIMITS)
    table.reserve("a", 0.0)
    table.reserve("b", 30.0)
    assert table.status(40.4) == {"a": {"circuits": 0, "expires_in": 60}, "b": {"circuits": 0, "expires_in": 90}}
    assert table.status(110.0) == {"b": {"circuits": 0, "expires_in": 20}}
    assert "a" not in table  # status expired it


def test_status_names_peers_by_their_text():
    table = Reservations(LIMITS)
    table.reserve(b"\x01" * 4, 0.0)
    assert list(table.status(0.0)) == [str(b"\x01" * 4)]


def test_a_circuit_needs_a_live_reservation_and_a_connection():
    table = Reservations(LIMITS)
    exc = refusal("no_reservation", table.open_circuit, "n", 0.0, connected=True)
    assert "no reservation for n" in str(exc)
    table.reserve("n", 0.0)
    refusal("no_reservation", table.open_circuit, "n", 1.0, connected=False)
    refusal("no_reservation", table.open_circuit, "n", 100.0, connected=True)  # expired
    assert table.status(100.0) == {}


def test_circuits_at_once_are_capped_per_reservation_and_closing_frees_one():
    table = Reservations(LIMITS)
    table.reserve("n", 0.0)
    first = table.open_circuit("n", 1.0, connected=True)
    table.open_circuit("n", 1.0, connected=True)
    exc = refusal("busy", table.open_circuit, "n", 2.0, connected=True)
    assert "2 circuits open" in str(exc)
    first.close()
    first.close()  # closing twice gives back one slot only
    assert table.status(3.0)["n"]["circuits"] == 1
    with table.open_circuit("n", 3.0, connected=True):
        assert table.status(3.0)["n"]["circuits"] == 2
    assert table.status(3.0)["n"]["circuits"] == 1


def test_a_circuit_carries_the_per_circuit_limits():
    table = Reservations(LIMITS)
    table.reserve("n", 0.0)
    circuit = table.open_circuit("n", 0.0, connected=True)
    assert circuit.seconds == 30.0
    assert circuit.budget.limit == 1000 and circuit.budget.carried == 0


def test_an_old_circuit_closing_never_touches_a_new_reservation():
    table = Reservations(LIMITS)
    table.reserve("n", 0.0)
    old = table.open_circuit("n", 1.0, connected=True)
    table.expire(100.0)
    table.reserve("n", 100.0)  # a fresh reservation after the old one lapsed
    table.open_circuit("n", 101.0, connected=True)
    old.close()
    assert table.status(102.0)["n"]["circuits"] == 1


def test_byte_budget_allows_the_limit_exactly_then_stays_closed():
    budget = ByteBudget(100)
    assert budget.carry(60) and budget.carry(40)
    assert not budget.carry(1)
    assert not budget.carry(0)  # once past, it stays past
    assert budget.carried == 101


@SETTINGS
@given(st.integers(0, 500), st.lists(st.integers(0, 100), max_size=30))
def test_byte_budget_says_yes_exactly_while_the_running_total_is_within_the_limit(limit, sizes):
    budget, total = ByteBudget(limit), 0
    for n in sizes:
        total += n
        assert budget.carry(n) is (total <= limit)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from("abcde"), st.floats(0, 80)), max_size=40))
def test_reservations_follow_the_model_of_a_capped_expiring_table(steps):
    table, model, now = Reservations(LIMITS), {}, 0.0
    for peer, step in steps:
        now += step
        model = {p: t for p, t in model.items() if t > now}
        if peer not in model and len(model) >= LIMITS.max_reservations:
            refusal("full", table.reserve, peer, now)
        else:
            table.reserve(peer, now)
            model[peer] = now + LIMITS.reservation_ttl
        assert set(table) == set(model)
        assert len(table) <= LIMITS.max_reservations


def test_held_reservations_report_seconds_left_and_hide_expired_ones():
    held = HeldReservations()
    held.held("r1", 100, now=0.0)
    held.held("r2", 10.0, now=0.0)
    assert held.status(4.6) == {"r1": 95, "r2": 5}
    assert held.status(10.0) == {"r1": 90}
    assert held.live(9.9) == ["r1", "r2"] and held.live(10.0) == ["r1"]
    assert held.holds("r2")  # still known: its relay may deliver a circuit it admitted
    assert not held.holds("r3")
    assert set(held) == {"r1", "r2"}


def test_a_renewed_reservation_counts_from_the_renewal():
    held = HeldReservations()
    held.held("r", 100.0, now=0.0)
    held.held("r", 100.0, now=90.0)
    assert held.status(150.0) == {"r": 40}


def test_parse_limits_keeps_the_four_limits_and_drops_the_rest():
    reply = {"ttl": 3600, "max_circuits": 16, "circuit_bytes": 1 << 27, "circuit_seconds": 600.0, "extra": "x"}
    assert parse_limits(reply) == {"ttl": 3600, "max_circuits": 16, "circuit_bytes": 1 << 27, "circuit_seconds": 600.0}
    assert parse_limits(RelayLimits().wire()) == RelayLimits().wire()


@pytest.mark.parametrize("change", [
    {"ttl": 0}, {"ttl": -1.0}, {"ttl": "3600"}, {"ttl": True}, {"ttl": math.nan}, {"ttl": math.inf}, {"ttl": None},
    {"max_circuits": 1.5}, {"max_circuits": -1}, {"circuit_bytes": "big"}, {"circuit_seconds": math.nan},
])
def test_parse_limits_refuses_a_bad_field(change):
    reply = {**RelayLimits().wire(), **change}
    with pytest.raises(Malformed) as caught:
        parse_limits(reply)
    assert caught.value.kind == "malformed"


@pytest.mark.parametrize("reply", [None, [], "ok", {"max_circuits": 1, "circuit_bytes": 1, "circuit_seconds": 1}])
def test_parse_limits_refuses_a_reply_of_the_wrong_shape(reply):
    with pytest.raises(Malformed):
        parse_limits(reply)


def test_renewal_comes_at_four_fifths_of_the_lifetime():
    assert renew_after(3600) == 2880.0
    assert renew_after(10.0) == 8.0


def test_errors_carry_a_known_kind():
    assert issubclass(Refused, NatError) and issubclass(Malformed, NatError)
    assert issubclass(Malformed, ValueError)
    with pytest.raises(ValueError):
        Refused("nope", "not a kind")


def test_the_pacer_lets_one_seconds_worth_through_at_once_then_charges_the_rest_in_turn():
    pacer = Pacer(1000.0)
    assert pacer.wait(600, now=0.0) == 0.0 and pacer.wait(400, now=0.0) == 0.0  # the burst: one second's worth
    assert pacer.wait(500, now=0.0) == pytest.approx(0.5)  # owed: half a second
    assert pacer.wait(500, now=0.0) == pytest.approx(1.0)  # queued behind it
    assert pacer.wait(100, now=10.0) == 0.0  # credit came back, up to one second's worth
    assert Pacer(0).wait(1 << 30, now=0.0) == 0.0  # rate 0: no pacing


@given(st.floats(1.0, 1e6), st.lists(st.tuples(st.floats(0, 2.0), st.integers(0, 100_000)), min_size=1, max_size=60))
@settings(max_examples=100, deadline=None)
def test_paced_bytes_never_run_ahead_of_the_rate_plus_one_burst(rate, sends):
    """Bytes released by any moment are at most a second's worth plus the rate times the time
    since the first send (released: when their wait ends)."""
    pacer, now, released = Pacer(rate), 0.0, []
    for gap, size in sends:
        now += gap
        released.append((now + pacer.wait(size, now), size))
    first = sends[0][0]
    for at, _ in released:
        passed = sum(size for when, size in released if when <= at)
        assert passed <= rate + rate * (at - first) + 1e-6 * passed + 1
