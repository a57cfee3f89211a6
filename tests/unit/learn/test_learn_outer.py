"""The outer step and the state hash beyond test_learn_math: torch's other SGD
paths, plain momentum, and what the hash covers."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from learn.outer import OuterSGD, state_hash


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("foreach", [True, False])
def test_the_outer_step_is_torch_sgd_to_float32_rounding_on_either_path(nesterov, foreach):
    generator = torch.Generator().manual_seed(8)
    theta = {"a": torch.randn(1000, generator=generator), "b": torch.randn(7, 3, generator=generator)}
    ours = OuterSGD(lr=0.7, momentum=0.9, nesterov=nesterov)
    params = {n: torch.nn.Parameter(t.clone()) for n, t in theta.items()}
    reference = torch.optim.SGD(params.values(), lr=0.7, momentum=0.9, nesterov=nesterov, foreach=foreach)
    for _ in range(10):
        delta = {n: torch.randn(t.shape, generator=generator) for n, t in theta.items()}
        theta = ours.step(theta, delta)
        for n, p in params.items():
            p.grad = delta[n].clone()
        reference.step()
    assert all(torch.allclose(theta[n], params[n].detach(), rtol=1e-5, atol=1e-5) for n in theta)
    assert all(torch.equal(ours.momentum[n], reference.state[params[n]]["momentum_buffer"]) for n in theta)


@pytest.mark.parametrize("nesterov", [True, False])
def test_the_outer_step_rounds_every_product_on_its_own_so_any_cpu_gets_the_same_bits(nesterov):
    """Each float32 op here is exact in float64 and then rounded once, so this
    reference is what any IEEE CPU computes, fused multiply-add or not."""
    generator = torch.Generator().manual_seed(3)
    theta = {"w": torch.randn(4096, generator=generator)}
    ours = OuterSGD(lr=0.7, momentum=0.9, nesterov=nesterov)
    lr, mu = torch.tensor(0.7).double(), torch.tensor(0.9).double()  # the scalars as float32 values

    def r(x):  # round a float64 result to float32, and back
        return x.float().double()

    w, b = theta["w"].double(), None
    for _ in range(5):
        d = torch.randn(4096, generator=generator)
        ours.step(theta, {"w": d})
        d = d.double()
        b = d if b is None else r(r(mu * b) + d)
        step = r(r(r(mu * b) + d) * lr) if nesterov else r(b * lr)
        w = r(w - step)
        assert torch.equal(theta["w"], w.float()) and torch.equal(ours.momentum["w"], b.float())


def test_the_outer_step_moves_theta_in_place_leaves_delta_alone_and_repeats_exactly():
    theta, delta = {"w": torch.randn(10)}, {"w": torch.randn(10)}
    twin, start, before = {"w": theta["w"].clone()}, theta["w"].clone(), delta["w"].clone()
    first, second = OuterSGD(), OuterSGD()
    held = theta["w"]
    for _ in range(3):
        assert first.step(theta, delta) is theta and theta["w"] is held  # no copy of the state
        second.step(twin, delta)
    assert torch.equal(theta["w"], twin["w"]) and not torch.equal(theta["w"], start)
    assert torch.equal(delta["w"], before)
    assert state_hash(first.momentum) == state_hash(second.momentum)
    with pytest.raises(ValueError, match="float32"):
        first.step({"w": torch.zeros(10, dtype=torch.float64)}, delta)


@given(st.integers(0, 99), st.integers(0, 31))
@settings(max_examples=60, deadline=None)
def test_the_state_hash_changes_with_any_single_bit(index, bit):
    generator = torch.Generator().manual_seed(9)
    theta, momentum = {"a": torch.randn(60, generator=generator), "b": torch.randn(40, generator=generator)}, {}
    flipped = {n: t.clone() for n, t in theta.items()}
    name, i = ("a", index) if index < 60 else ("b", index - 60)
    flipped[name].view(torch.int32)[i] ^= (1 << bit) - (1 << 32 if bit == 31 else 0)
    assert state_hash(theta, momentum) != state_hash(flipped, momentum)
    assert state_hash(theta, momentum) == state_hash({n: t.clone() for n, t in theta.items()}, {})


def test_the_state_hash_covers_names_dtypes_shapes_and_which_state():
    w = torch.zeros(6)
    base = state_hash({"w": w}, {})
    assert base != state_hash({"v": w}, {})
    assert base != state_hash({"w": w.view(2, 3)}, {})
    assert base != state_hash({"w": w.view(torch.int32)}, {})
    assert base != state_hash({}, {"w": w})
    assert state_hash({"w": torch.arange(6.0).view(2, 3).t()}, {}) == \
        state_hash({"w": torch.arange(6.0).view(2, 3).t().contiguous()}, {})


def test_the_state_hash_does_not_depend_on_how_many_threads_torch_runs():
    state = {"w": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(3)}  # 4 MiB: blake3 splits it
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = state_hash(state, state)
        torch.set_num_threads(4)
        assert state_hash(state, state) == one
    finally:
        torch.set_num_threads(threads)
