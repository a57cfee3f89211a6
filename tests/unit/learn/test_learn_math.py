"""Merge rules, robust aggregation, the outer step, the state hash and fragments."""

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from learn.allreduce import partition
from learn.fragments import due, mix, split
from learn.merge import MergeError, conservative, merge_state, mergeable, variance_corrected
from learn.outer import OuterSGD, state_hash
from learn.robust import aggregate, parse_rule


def test_variance_correction_restores_the_received_variance():
    torch.manual_seed(0)
    own = torch.randn(1000)
    received = [torch.randn(1000) * 2 for _ in range(4)]  # independent: their mean shrinks
    merged = variance_corrected(own, received)
    target = torch.stack([r.var(unbiased=False) for r in received]).mean()
    assert torch.isclose(merged.var(unbiased=False), target, rtol=1e-3)
    plain = torch.stack([own, *received]).mean(0)
    assert plain.var(unbiased=False) < 0.5 * target  # what the correction undoes


def test_conservative_keeps_c_of_the_own_model_before_correction():
    own, other = torch.ones(10) * torch.arange(10), torch.zeros(10)
    merged = conservative(own, [other], c=1.0)
    assert torch.allclose(merged, own, atol=1e-4)


def test_merge_state_leaves_batchnorm_statistics_and_scalars_alone():
    own = {"w": torch.randn(4, 4), "bn.running_mean": torch.zeros(4), "bn.num_batches_tracked": torch.tensor(3),
           "scale": torch.tensor([2.0])}
    other = {"w": torch.randn(4, 4), "bn.running_mean": torch.ones(4), "bn.num_batches_tracked": torch.tensor(9),
             "scale": torch.tensor([5.0])}
    merged = merge_state(own, [other], "mean")
    assert torch.allclose(merged["w"], (own["w"] + other["w"]) / 2)
    for name in ("bn.running_mean", "bn.num_batches_tracked", "scale"):
        assert not mergeable(name, own[name]) and torch.equal(merged[name], own[name])
    with pytest.raises(MergeError, match="w"):
        merge_state(own, [{**other, "w": torch.randn(3)}], "mean")


def test_merging_identical_models_changes_nothing():
    state = {"w": torch.randn(8, 8)}
    for rule in ("mean", "variance_corrected", "conservative"):
        assert torch.allclose(merge_state(state, [state, state], rule)["w"], state["w"], atol=1e-5)


@pytest.mark.parametrize("rule", ["trimmed_mean", "centered_clip"])
def test_one_huge_contribution_moves_a_robust_aggregate_little(rule):
    torch.manual_seed(1)
    honest = [torch.randn(500) * 0.1 + 1.0 for _ in range(7)]
    attacked = aggregate([*honest, torch.randn(500) * 1e6], None, rule)
    clean = torch.stack(honest).mean(0)
    assert (attacked.value - clean).norm() < 0.5 * clean.norm()
    assert 7 in attacked.clipped
    assert (aggregate([*honest, torch.randn(500) * 1e6], None, "mean").value - clean).norm() > 1e4


def test_rules_parse_or_say_what_they_accept():
    assert parse_rule("trimmed_mean:0.25").param == 0.25
    for bad in ("median", "trimmed_mean:0.7", "centered_clip:-1", "mean:3"):
        with pytest.raises(ValueError):
            parse_rule(bad)


def test_the_outer_step_is_torch_nesterov_sgd_to_float32_rounding():
    torch.manual_seed(2)
    theta = {"a": torch.randn(50), "b": torch.randn(3, 3)}
    ours = OuterSGD(lr=0.7, momentum=0.9)
    params = {n: torch.nn.Parameter(t.clone()) for n, t in theta.items()}
    reference = torch.optim.SGD(params.values(), lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(5):
        delta = {n: torch.randn_like(t) for n, t in theta.items()}
        theta = ours.step(theta, delta)
        for n, p in params.items():
            p.grad = delta[n].clone()
        reference.step()
        for n in theta:
            assert torch.allclose(theta[n], params[n].detach(), rtol=1e-5, atol=1e-6)


def test_the_state_hash_sees_every_bit():
    state = {"w": torch.randn(100)}
    same = {"w": state["w"].clone()}
    assert state_hash(state, {}) == state_hash(same, {})
    same["w"][37] = torch.nextafter(same["w"][37], torch.tensor(10.0))
    assert state_hash(state, {}) != state_hash(same, {})


def test_streaming_fragments_are_strided_and_sync_in_turn():
    assert split(["l0.w", "l1.w", "l1.b", "l2.w", "l3.w", "l4.w"], 2) == [["l0.w", "l2.w", "l4.w"], ["l1.w", "l1.b", "l3.w"]]
    starts = {step: due(step, 100, 4) for step in range(1, 201) if due(step, 100, 4)}
    assert starts == {25: [0], 50: [1], 75: [2], 100: [3], 125: [0], 150: [1], 175: [2], 200: [3]}
    assert torch.equal(mix(torch.ones(2), torch.zeros(2), 0.5), torch.full((2,), 0.5))
    with pytest.raises(ValueError):
        split(["a"], 2)


@given(st.integers(0, 10_000), st.integers(1, 40))
@settings(max_examples=100, deadline=None)
def test_a_partition_covers_the_vector_once_in_balanced_slices(total, n):
    members = sorted(random.Random(n).randbytes(32) for _ in range(n))
    ranges = partition(total, members)
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1
