"""learn.simnet: gossip averaging and DiLoCo's all-reduce among many members in one process,
with churn, deaths and slow links."""

import random

import pytest
import torch

from learn.simnet import (AllReduceResult, Links, SimResult, allreduce_round, predicted_rounds, simulate,
                          simulate_allreduce, wire_bytes)
from learn.tensors import tensor_bytes


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


def test_the_prediction_for_fresh_random_partners_matches_the_simulation_on_a_fast_network():
    for seed in range(2):
        result = simulate(members=64, d=4, churn=0.0, dim=100, latency=0.001, jitter=0.0, seed=seed)
        predicted = predicted_rounds(result.start_spread, 4)
        assert result.start_spread > result.history[0].spread
        assert predicted - 1 <= result.rounds <= predicted + 2
    assert predicted_rounds(0.005, 4) == 0 and predicted_rounds(1.0, 0) == float("inf")
    assert predicted_rounds(1.0, 3) == 7  # 1 -> 0.01 at spread ÷ 2 a round: 2^7 = 128 > 100


# --- the all-reduce ---------------------------------------------------------------------------------

def _keys(n, seed=0):
    rng = random.Random(seed)
    return sorted(rng.randbytes(32) for _ in range(n))


def _vectors(keys, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {key: torch.randn(dim, generator=gen) for key in keys}


def _results(exchange):
    return {m: exchange.ars[m].result() for m in exchange.survivors()}


def test_on_a_fast_network_every_member_ends_with_the_same_bits_the_mean_and_2_n_minus_1_over_n_bytes():
    result = simulate_allreduce(members=24, rounds=2, dim=480, jitter=0.0, seed=1)
    assert isinstance(result, AllReduceResult) and len(result.history) == 2
    for h in result.history:
        assert h.contributors == h.survivors == h.finished == h.agreeing == 24 and h.identical
        assert h.died == h.joined == h.left_out == h.late == h.missing_somewhere == h.missing_everywhere == 0
        # each member sends N-1 parts of its vector and its reduced part N-1 times: 2 (N-1)/N of the vector
        assert h.payload_per_member == h.ideal_per_member == 2 * 23 / 24 * 4 * 480
        assert h.wire_per_member > h.payload_per_member  # heads, signatures, lists of members

    keys = _keys(24)
    vectors = _vectors(keys, 480)
    exchange = allreduce_round(vectors, Links(random.Random(0), 0.01, 0.0))
    results = _results(exchange)
    assert len(results) == 24 and len({bytes(tensor_bytes(r)) for r in results.values()}) == 1
    assert torch.allclose(results[keys[0]], torch.stack(list(vectors.values())).mean(dim=0), atol=1e-6)


def test_lists_of_members_cost_most_of_the_wire_bytes_unless_compact():
    full = simulate_allreduce(members=24, rounds=1, dim=480, jitter=0.0, seed=1, compact_lists=False).history[0]
    compact = simulate_allreduce(members=24, rounds=1, dim=480, jitter=0.0, seed=1).history[0]  # as meshd sends them
    assert full.payload_per_member == compact.payload_per_member
    assert compact.wire_per_member < full.wire_per_member / 2
    # the member lists: 34 bytes a member, in each of 2 (N-1) messages a member sends
    assert full.wire_per_member - compact.wire_per_member > 2 * 23 * 24 * 30


def test_slow_links_leave_parts_out_and_members_short_but_every_finisher_holds_the_same_bits():
    h = simulate_allreduce(members=24, rounds=1, dim=480, jitter=1.0, timeout=0.5, seed=2).history[0]
    assert h.late > 0 and h.left_out > 0  # parts past the parts deadline: their reducers went without them
    assert 0 < h.finished < h.survivors == 24  # a reduced part past the deadline: that member does not finish
    assert h.missing_somewhere > 0 == h.missing_everywhere
    assert h.identical and h.agreeing == h.finished  # those short of a part each lack a different one


def test_a_reducer_dead_from_the_start_leaves_its_part_missing_for_everyone_and_only_that():
    keys = _keys(16, 3)
    dead = keys[5]
    exchange = allreduce_round(_vectors(keys, 320), Links(random.Random(3), 0.01, 0.5), deaths={dead: 0.0})
    survivors = exchange.survivors()
    assert survivors == [k for k in keys if k != dead]
    assert exchange.payload[dead] == exchange.wire[dead] == 0  # it sent nothing
    for member in survivors:
        ar = exchange.ars[member]
        assert ar.missing_parts() == [5] and ar.result() is None
        assert ar.contributors_missing() == [dead]  # every reduction went without its part
    held = {tuple(bytes(tensor_bytes(exchange.ars[m].reduced(i)[0])) for i in range(16) if i != 5) for m in survivors}
    assert len(held) == 1  # the parts they have, they all have with the same bits
    h = exchange.stats()
    assert h.died == 1 and h.missing_everywhere == h.missing_somewhere == 1 and h.finished == 0
    assert h.agreeing == 15 and h.left_out == 15


def test_a_member_that_dies_after_sending_its_reduced_part_costs_the_others_nothing():
    keys = _keys(16, 4)
    late_death = {keys[7]: 1.9}  # the round's deadline is 2.0; its part went out long before
    exchange = allreduce_round(_vectors(keys, 320), Links(random.Random(4), 0.01, 0.5), deaths=late_death)
    results = _results(exchange)
    assert len(results) == 15 and keys[7] not in results
    assert len({bytes(tensor_bytes(r)) for r in results.values()}) == 1
    assert all(exchange.ars[m].reduced(7)[1] == keys for m in results)  # its reduction had everyone's part


def test_a_lossy_codec_still_leaves_every_member_with_the_reducers_bits():
    h = simulate_allreduce(members=16, rounds=1, dim=512, jitter=0.0, codec="int8", seed=5).history[0]
    assert h.finished == 16 and h.identical and h.agreeing == 16
    assert h.payload_per_member < h.ideal_per_member / 3  # a byte a value, and a scale per 64


def test_deaths_are_replaced_by_members_who_sit_out_their_first_round():
    history = simulate_allreduce(members=20, rounds=3, deaths=0.1, dim=200, seed=1).history
    assert [h.died for h in history] == [2, 1, 1]  # a tenth of the round's contributors, rounded down
    assert [h.joined for h in history] == [0, 2, 1]  # the last round's dead, replaced
    assert all(h.contributors + h.joined == 20 for h in history)
    assert all(h.survivors == h.contributors - h.died for h in history)


def test_the_same_seed_gives_the_same_all_reduce_run():
    one = simulate_allreduce(members=12, rounds=2, deaths=0.2, dim=100, seed=7)
    assert one == simulate_allreduce(members=12, rounds=2, deaths=0.2, dim=100, seed=7)
    assert one != simulate_allreduce(members=12, rounds=2, deaths=0.2, dim=100, seed=8)


def test_bad_all_reduce_parameters_are_refused():
    for bad in [{"members": 0}, {"rounds": 0}, {"dim": 0}, {"deaths": 1.0}, {"deaths": -0.1}, {"timeout": 0.0},
                {"jitter": -1.0}]:
        with pytest.raises(ValueError):
            simulate_allreduce(**{"members": 4, "dim": 8, **bad})
    with pytest.raises(ValueError):
        allreduce_round(_vectors(_keys(2), 4), Links(random.Random(0), 0.01, 0.0), bandwidth=0.0)
