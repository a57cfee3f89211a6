"""Merge rules beyond test_learn_math: weights, the variance targets as
properties, dtypes, refusals, and bits that do not depend on the thread count."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from learn.merge import MergeError, conservative, mean, merge_state, variance_corrected


def _var(t):
    return t.double().var(unbiased=False)


def test_weights_are_sample_counts_own_first():
    own, other = torch.zeros(10), torch.ones(10)
    assert torch.allclose(mean(own, [other], weights=[3, 1]), torch.full((10,), 0.25))
    assert torch.equal(mean(own, [other]), torch.full((10,), 0.5))


@given(st.integers(1, 5), st.floats(0.01, 100), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_variance_corrected_has_the_received_mean_variance(k, scale, seed):
    generator = torch.Generator().manual_seed(seed)
    own = torch.randn(2000, generator=generator) * scale
    received = [torch.randn(2000, generator=generator) * scale * (i + 1) for i in range(k)]
    target = sum(_var(r) for r in received) / k
    merged = variance_corrected(own, received)
    plain = _var(mean(own, received))  # the 1e-4 in the ratio damps tiny variances:
    assert float(_var(merged)) == pytest.approx(float(plain * (target + 1e-4) / (plain + 1e-4)), rel=1e-3)
    if plain > 1:
        assert float(_var(merged)) == pytest.approx(float(target), rel=1e-3)
    assert float(merged.double().mean()) == pytest.approx(float(mean(own, received).double().mean()),
                                                          abs=1e-4 * scale * k)


@given(st.floats(0, 1), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_conservative_has_the_c_weighted_variance(c, seed):
    generator = torch.Generator().manual_seed(seed)
    own = torch.randn(1000, generator=generator)
    received = [torch.randn(1000, generator=generator) * 3, torch.randn(1000, generator=generator) * 2]
    target = c * _var(own) + (1 - c) * (_var(received[0]) + _var(received[1])) / 2
    assert float(_var(conservative(own, received, c))) == pytest.approx(float(target), rel=2e-3)


def test_merge_state_casts_back_and_leaves_its_inputs_alone():
    own = {"w": torch.randn(6, 6).to(torch.bfloat16)}
    received = [{"w": torch.randn(6, 6)}]  # as a quantized codec decodes: float32
    before = own["w"].clone()
    merged = merge_state(own, received, "variance_corrected")
    assert merged["w"].dtype == torch.bfloat16 and torch.equal(own["w"], before)
    assert merge_state(own, [], "mean")["w"] is not own["w"]


def test_merge_state_refuses_what_does_not_match_naming_the_entry():
    own = {"layer.weight": torch.randn(4)}
    with pytest.raises(MergeError, match="layer.weight"):
        merge_state(own, [{}], "mean")
    with pytest.raises(MergeError, match="layer.weight"):
        merge_state(own, [{"layer.weight": torch.randn(5)}], "mean")
    with pytest.raises(MergeError, match="layer.weight"):
        merge_state(own, [{"layer.weight": torch.arange(4)}], "mean")
    with pytest.raises(ValueError, match="rule"):
        merge_state(own, [own], "median")
    with pytest.raises(ValueError, match="weights"):
        merge_state(own, [own], "mean", weights=[1.0])
    with pytest.raises(ValueError, match="weights"):
        merge_state(own, [own], "mean", weights=[0, 0])
    with pytest.raises(ValueError, match="c "):
        merge_state(own, [own], "conservative", c=1.5)
    with pytest.raises(ValueError, match="received"):
        variance_corrected(own["layer.weight"], [])


def test_merged_bits_do_not_depend_on_the_thread_count():
    generator = torch.Generator().manual_seed(3)
    own = torch.randn(300_001, generator=generator)
    received = [torch.randn(300_001, generator=generator) * 2 for _ in range(3)]
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 4):
            torch.set_num_threads(n)
            results.append([variance_corrected(own, received), conservative(own, received, 0.3)])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))
