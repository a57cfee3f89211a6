"""learn.simnet: gossip averaging of many members in one process, with churn and slow links."""

import pytest

from learn.simnet import SimResult, simulate, wire_bytes


def test_gossip_averaging_converges_on_a_steady_fast_network():
    result = simulate(members=32, d=4, churn=0.0, dim=200, latency=0.001, jitter=0.0, seed=1)
    assert isinstance(result, SimResult) and result.converged
    assert result.rounds == len(result.history) < 30
    assert result.history[-1].spread <= 0.01 < result.history[0].spread
    assert all(h.live == 32 and h.joined == h.left == h.late == h.gone == 0 for h in result.history)
    # each member pulls d whole vectors a round, as the wire carries them
    assert result.bytes_per_member_per_round == 4 * wire_bytes(200)


def test_gossip_averaging_converges_through_churn_and_slow_links():
    result = simulate(members=32, d=4, churn=0.1, dim=200, latency=0.05, jitter=1.0, timeout=0.5, seed=2)
    assert result.converged and result.rounds < 30
    history = result.history
    assert sum(h.left for h in history) > 0 and sum(h.joined for h in history) > 0  # churn
    assert all(h.live == 32 for h in history)  # as many join as leave
    assert sum(h.gone for h in history) > 0  # partners that had left: skipped at the timeout
    assert sum(h.late for h in history) > 0  # partners over slow links: skipped at the timeout
    assert all(h.late + h.gone <= h.pulls for h in history)


def test_spread_falls_as_rounds_go_by():
    history = simulate(members=32, d=2, churn=0.0, dim=100, seed=3).history
    spreads = [h.spread for h in history]
    assert spreads[5] < spreads[0] / 10 and spreads[-1] <= 0.01


def test_a_simulation_that_cannot_converge_stops_at_rounds_max():
    result = simulate(members=16, d=0, churn=0.0, dim=50, rounds_max=5, seed=4)
    assert not result.converged and result.rounds == 5 == len(result.history)
    assert result.bytes_per_member_per_round == 0


def test_the_same_seed_gives_the_same_run():
    one = simulate(members=24, churn=0.2, dim=50, seed=5)
    assert one == simulate(members=24, churn=0.2, dim=50, seed=5)
    assert one != simulate(members=24, churn=0.2, dim=50, seed=6)


def test_bad_parameters_are_refused():
    for bad in [{"members": 1}, {"churn": 1.0}, {"churn": -0.1}, {"d": -1}, {"dim": 0}, {"rounds_max": 0}]:
        with pytest.raises(ValueError):
            simulate(**{"members": 8, **bad})
