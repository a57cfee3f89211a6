"""Streaming DiLoCo's schedule beyond test_learn_math: every fragment once per
H steps, evenly spaced, the split covers each name once, and refusals."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from learn.fragments import acting, due, lands, mix, overlap_steps, split


@given(st.integers(1, 200), st.data())
@settings(max_examples=100, deadline=None)
def test_every_fragment_syncs_once_in_any_h_consecutive_steps(inner_steps, data):
    parts = data.draw(st.integers(1, inner_steps))
    start = data.draw(st.integers(1, 3 * inner_steps))
    synced = [p for step in range(start, start + inner_steps) for p in due(step, inner_steps, parts)]
    assert sorted(synced) == list(range(parts))
    assert due(inner_steps, inner_steps, parts)[-1] == parts - 1  # the last one ends the outer round


def test_fragments_start_in_order_evenly_spaced():
    starts = [step for step in range(1, 31) if due(step, 30, 3)]
    assert starts == [10, 20, 30] and [due(s, 30, 3) for s in starts] == [[0], [1], [2]]
    assert due(0, 30, 3) == [] and due(-30, 30, 3) == []
    assert [due(s, 5, 1) for s in (4, 5, 10)] == [[], [0], [0]]


@given(st.lists(st.integers(1, 3), min_size=1, max_size=30), st.data())
@settings(max_examples=60, deadline=None)
def test_the_split_strides_whole_layers_and_keeps_every_name_once_in_model_order(widths, data):
    names = [f"block{i}.{part}" for i, width in enumerate(widths) for part in ("weight", "bias", "scale")[:width]]
    parts = data.draw(st.integers(1, len(widths)))
    fragments = split(names, parts)
    assert len(fragments) == parts and all(fragments)
    assert sorted(n for f in fragments for n in f) == sorted(names)
    assert all(f == sorted(f, key=names.index) for f in fragments)
    assert all(int(n.split(".")[0][5:]) % parts == p for p, f in enumerate(fragments) for n in f)


def test_a_layers_weight_and_bias_stay_in_one_fragment():
    names = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias", "head"]
    assert split(names, 2) == [["0.weight", "0.bias", "4.weight", "4.bias"], ["2.weight", "2.bias", "head"]]
    assert split(names, 4) == [["0.weight", "0.bias"], ["2.weight", "2.bias"], ["4.weight", "4.bias"], ["head"]]


def test_bad_schedules_are_refused():
    for inner_steps, parts in ((0, 1), (5, 0), (5, 6)):
        with pytest.raises(ValueError):
            due(1, inner_steps, parts)
    with pytest.raises(ValueError):
        split([], 1)
    with pytest.raises(ValueError):
        split(["a", "b"], 0)
    with pytest.raises(ValueError, match="layers"):
        split(["l0.weight", "l0.bias"], 2)  # one layer cannot make two fragments


def test_the_overlap_defaults_to_half_a_fragments_turn_and_is_bounded_by_it():
    assert [overlap_steps(h, p) for h, p in ((50, 4), (8, 2), (4, 4), (10, 1))] == [6, 2, 1, 5]
    assert overlap_steps(50, 4, 12) == 12
    for h, p, tau, words in ((50, 4, 13, "overlap must be 1 to H/P"), (50, 4, 0, "overlap"),
                             (4, 5, None, "fragments must be 1 to inner_steps"), (0, 1, None, "inner_steps"),
                             (8, 2.0, None, "fragments")):
        with pytest.raises(ValueError, match=words):
            overlap_steps(h, p, tau)


@given(st.integers(1, 100), st.data())
@settings(max_examples=60, deadline=None)
def test_each_fragment_lands_overlap_steps_after_it_started(inner_steps, data):
    parts = data.draw(st.integers(2, inner_steps)) if inner_steps > 1 else 1
    tau = overlap_steps(inner_steps, parts, data.draw(st.integers(1, inner_steps // parts)))
    for step in range(1, 4 * inner_steps):
        assert lands(step + tau, inner_steps, parts, tau) == due(step, inner_steps, parts)
    assert all(lands(step, inner_steps, parts, tau) == [] for step in range(-1, tau + 1))


def test_a_member_acts_at_the_outer_sync_or_where_a_fragment_starts_or_lands():
    assert [s for s in range(1, 13) if acting(s, 4, 1, 2)] == [4, 8, 12]  # no fragments: the outer syncs
    assert [(s, acting(s, 8, 2, 2)) for s in range(1, 17) if acting(s, 8, 2, 2)] == [
        (4, [0]), (6, [0]), (8, [1]), (10, [1]), (12, [0]), (14, [0]), (16, [1])]
    assert acting(8, 4, 2, 2) == [0, 1]  # fragment 0 starts as fragment 1 lands: both, in order


def test_mix_is_alpha_local_plus_one_minus_alpha_global():
    local, global_ = torch.tensor([4.0, 0.0]), torch.tensor([0.0, 8.0])
    assert torch.equal(mix(local, global_, 0.25), torch.tensor([1.0, 6.0]))
    assert torch.equal(mix(local, global_, 1.0), local)
