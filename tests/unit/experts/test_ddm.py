"""DDM routing: the four modes, the experts to call, combining the outputs of
those that answered, and the flow-matching helpers."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from experts.ddm import (MODES, combine, euler_step, euler_times, interpolate, needed, route,
                         target_velocity)


def logits(batch: int, experts: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, experts, generator=torch.Generator().manual_seed(seed)) * 3


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 6), experts=st.integers(1, 7), mode=st.sampled_from(MODES),
       seed=st.integers(0, 2**16), data=st.data())
def test_every_mode_gives_non_negative_rows_that_sum_to_one(batch, experts, mode, seed, data):
    k = data.draw(st.integers(1, experts))
    w = route(logits(batch, experts, seed), mode, k)
    assert w.shape == (batch, experts) and (w >= 0).all()
    assert torch.allclose(w.sum(dim=1), torch.ones(batch), atol=1e-6)


def test_full_is_the_softmax():
    x = logits(4, 5, seed=1)
    assert torch.allclose(route(x, "full"), torch.softmax(x, dim=1))


def test_top1_is_the_one_hot_of_the_largest_logit_and_ties_go_to_the_lower_index():
    x = logits(8, 5, seed=2)
    w = route(x, "top1")
    assert torch.equal(w, torch.nn.functional.one_hot(x.argmax(dim=1), 5).float())
    assert route(torch.tensor([[1.0, 3.0, 3.0]]), "top1").tolist() == [[0.0, 1.0, 0.0]]


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_topk_keeps_the_k_largest_logits_and_renormalizes_their_softmax(k):
    x = logits(6, 5, seed=3)
    w = route(x, "topk", k)
    assert ((w > 0).sum(dim=1) == k).all()
    top = x.topk(k, dim=1).indices
    assert torch.equal(w > 0, torch.zeros_like(w, dtype=torch.bool).scatter_(1, top, True))
    for b in range(6):
        kept = top[b]
        assert torch.allclose(w[b, kept], torch.softmax(x[b, kept], dim=0), atol=1e-6)


def test_uniform_ignores_the_logits():
    assert torch.equal(route(logits(3, 4, seed=4), "uniform"), torch.full((3, 4), 0.25))


def test_a_minus_inf_logit_turns_an_expert_off():
    w = route(torch.tensor([[0.0, -math.inf, 1.0]]), "full")
    assert w[0, 1] == 0 and w.sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize("args", [
    (torch.zeros(2, 3), "top2", 2),
    (torch.zeros(2, 3), "topk", 0),
    (torch.zeros(2, 3), "topk", 4),
    (torch.zeros(2, 3), "topk", 1.5),
    (torch.zeros(3), "full", 2),
    (torch.zeros(2, 0), "full", 2),
    (torch.zeros(2, 3, dtype=torch.long), "full", 2),
    (torch.tensor([[0.0, float("nan")]]), "full", 2),
    (torch.tensor([[-math.inf, -math.inf]]), "full", 2),
])
def test_an_unknown_mode_a_bad_k_or_bad_logits_are_value_errors(args):
    with pytest.raises(ValueError):
        route(*args)


def test_needed_lists_the_experts_with_some_weight_sorted():
    w = torch.tensor([[0.0, 0.7, 0.0, 0.3], [0.0, 0.0, 0.0, 1.0]])
    assert needed(w) == [1, 3]
    assert needed(route(logits(5, 6, seed=5), "uniform")) == list(range(6))
    assert needed(torch.zeros(0, 3)) == []


def test_combine_matches_a_hand_computation_over_all_experts():
    w = torch.tensor([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0]])
    outs = {0: torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
            1: torch.tensor([[10.0, 20.0], [30.0, 40.0]]),
            2: torch.tensor([[100.0, 200.0], [300.0, 400.0]])}
    got, used = combine(w, outs)
    assert torch.allclose(got, torch.tensor([[0.5 + 2.5 + 25.0, 1.0 + 5.0 + 50.0], [30.0, 40.0]]))
    assert used == [0, 1, 2]


def test_combine_renormalizes_each_row_over_the_experts_present():
    w = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.0, 0.9]])
    outs = {0: torch.tensor([[1.0], [1.0]]), 2: torch.tensor([[2.0], [2.0]])}  # expert 1 did not answer
    got, used = combine(w, outs)
    want = torch.tensor([[(0.5 * 1 + 0.2 * 2) / 0.7], [(0.1 * 1 + 0.9 * 2) / 1.0]])
    assert torch.allclose(got, want) and used == [0, 2]


def test_a_row_whose_experts_all_missed_takes_the_plain_average_of_those_present():
    w = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    outs = {0: torch.tensor([[1.0, 1.0], [5.0, 5.0]]), 2: torch.tensor([[3.0, 3.0], [7.0, 7.0]])}
    got, used = combine(w, outs)
    assert torch.allclose(got, torch.tensor([[2.0, 2.0], [5.0, 5.0]])) and used == [0, 2]


def test_combine_reports_only_the_experts_that_carry_weight_and_keeps_image_shapes():
    w = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    outs = {0: torch.ones(2, 3, 4, 4), 1: torch.zeros(2, 3, 4, 4)}  # 1 answered a hedge, weighs nothing
    got, used = combine(w, outs)
    assert got.shape == (2, 3, 4, 4) and torch.equal(got, torch.ones(2, 3, 4, 4)) and used == [0]


@pytest.mark.parametrize("weights, outputs", [
    (torch.ones(2, 2) / 2, {}),
    (torch.ones(2, 2) / 2, {2: torch.zeros(2, 3)}),
    (torch.ones(2, 2) / 2, {0: torch.zeros(3, 3)}),
    (torch.ones(2, 2) / 2, {0: torch.zeros(2, 3), 1: torch.zeros(2, 4)}),
    (-torch.ones(2, 2), {0: torch.zeros(2, 3)}),
    (torch.full((2, 2), math.nan), {0: torch.zeros(2, 3)}),
    (torch.ones(2), {0: torch.zeros(2, 3)}),
])
def test_combine_refuses_no_outputs_and_disagreeing_shapes(weights, outputs):
    with pytest.raises(ValueError):
        combine(weights, outputs)


def test_interpolation_runs_from_noise_at_zero_to_data_at_one_along_the_target_velocity():
    g = torch.Generator().manual_seed(6)
    x0, x1 = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    assert torch.equal(interpolate(x0, x1, 0.0), x0) and torch.equal(interpolate(x0, x1, 1.0), x1)
    v = target_velocity(x0, x1)
    assert torch.allclose(interpolate(x0, x1, 0.3) + 0.4 * v, interpolate(x0, x1, 0.7), atol=1e-6)
    t = torch.tensor([0.0, 0.25, 0.5, 1.0])
    per_sample = interpolate(x0, x1, t)
    for b in range(4):
        assert torch.allclose(per_sample[b], interpolate(x0[b:b + 1], x1[b:b + 1], t[b].item())[0])


def test_euler_steps_along_the_true_velocity_reach_the_data():
    g = torch.Generator().manual_seed(7)
    x0, x1 = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    times = euler_times(8)
    assert times == [i / 8 for i in range(8)]
    x = x0
    for t in times:
        assert torch.allclose(x, interpolate(x0, x1, t), atol=1e-5)
        x = euler_step(x, target_velocity(x0, x1), 1 / 8)
    assert torch.allclose(x, x1, atol=1e-5)


def test_flow_helpers_refuse_bad_shapes_times_and_steps():
    a, b = torch.zeros(2, 3), torch.zeros(2, 4)
    for call in (lambda: interpolate(a, b, 0.5), lambda: target_velocity(a, b), lambda: euler_step(a, b, 0.1),
                 lambda: interpolate(a, a, 1.5), lambda: interpolate(a, a, torch.tensor([0.5, 2.0])),
                 lambda: interpolate(a, a, torch.zeros(3)), lambda: interpolate(a, a, torch.zeros(2, 1)),
                 lambda: euler_times(0), lambda: euler_times(2.0)):
        with pytest.raises(ValueError):
            call()
