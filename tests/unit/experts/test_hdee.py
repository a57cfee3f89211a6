"""HDEE mixing: the posterior weights against a naive loop, the prior at the
first token, an expert that knows the text taking over, dropped experts,
block-by-block decoding against the whole sequence, and the cached prior."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from experts.hdee import Posterior, estimate_prior, posterior_mixture, uniform_mixture


def random_logp(experts: int, positions: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    """Log-probabilities of tokens: each expert's log-softmax over a small
    vocabulary, read at random targets."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(experts, positions, 11, generator=g, dtype=torch.float64) * 2
    targets = torch.randint(0, 11, (positions,), generator=g)
    logp = torch.log_softmax(logits, dim=2)[:, torch.arange(positions), targets]
    return logp.to(dtype)


def naive(logp: torch.Tensor, prior: list[float]) -> tuple[list[float], list[list[float]]]:
    """The definition, one position at a time, in probabilities (float64)."""
    experts, positions = logp.shape
    total = sum(prior)
    w = [p / total for p in prior]
    mix, weights = [], []
    for t in range(positions):
        weights.append(list(w))
        probs = [math.exp(logp[e, t].item()) for e in range(experts)]
        mix.append(math.log(sum(w[e] * probs[e] for e in range(experts))))
        joint = [w[e] * probs[e] for e in range(experts)]
        w = [j / sum(joint) for j in joint]
    return mix, weights


@settings(max_examples=30, deadline=None)
@given(experts=st.integers(1, 5), positions=st.integers(0, 12), seed=st.integers(0, 2**16),
       prior=st.lists(st.floats(0.05, 1.0), min_size=5, max_size=5))
def test_posterior_mixture_equals_the_naive_loop(experts, positions, seed, prior):
    logp = random_logp(experts, positions, seed)
    prior = prior[:experts]
    mix, log_w = posterior_mixture(logp, torch.tensor(prior, dtype=torch.float64).log())
    want_mix, want_w = naive(logp, prior)
    assert mix.shape == (positions,) and log_w.shape == (experts, positions)
    assert torch.allclose(mix, torch.tensor(want_mix, dtype=torch.float64), atol=1e-9)
    if positions:
        assert torch.allclose(log_w.exp(), torch.tensor(want_w, dtype=torch.float64).T, atol=1e-9)


def test_weights_before_the_first_token_are_the_normalized_prior():
    logp = random_logp(3, 6, seed=1, dtype=torch.float32)
    prior = torch.tensor([0.5, 0.3, 0.2]).log() + 7.0  # unnormalized on purpose
    _, log_w = posterior_mixture(logp, prior)
    assert torch.allclose(log_w[:, 0].exp(), torch.tensor([0.5, 0.3, 0.2]), atol=1e-6)
    _, log_w = posterior_mixture(logp)
    assert torch.allclose(log_w[:, 0].exp(), torch.full((3,), 1 / 3), atol=1e-6)


def test_every_column_of_the_weights_is_a_distribution_and_float32_comes_back_float32():
    logp = random_logp(4, 50, seed=2, dtype=torch.float32)
    mix, log_w = posterior_mixture(logp)
    assert mix.dtype == log_w.dtype == torch.float32
    assert torch.allclose(log_w.exp().sum(dim=0), torch.ones(50), atol=1e-5)


def test_an_expert_that_predicts_the_text_takes_over_the_weights():
    logp = random_logp(4, 200, seed=3)
    logp[2] = math.log(0.99)  # expert 2 gives every token probability 0.99
    mix, log_w = posterior_mixture(logp)
    assert log_w[2, -1].exp() > 0.999
    assert (log_w[2, 1:] >= log_w[2, :-1] - 1e-12).all()  # it only gains
    assert torch.allclose(mix[-20:], logp[2, -20:], atol=1e-3)  # the mixture follows it


def test_the_mixture_is_never_far_below_the_best_expert_on_the_whole_text():
    logp = random_logp(5, 300, seed=4)
    mix, _ = posterior_mixture(logp)
    best = logp.sum(dim=1).max()
    assert mix.sum() >= best - math.log(5) - 1e-9


def test_a_minus_inf_prior_turns_an_expert_off():
    logp = random_logp(3, 10, seed=5)
    mix, log_w = posterior_mixture(logp, torch.tensor([0.0, -math.inf, 0.0], dtype=torch.float64))
    assert (log_w[1] == -math.inf).all()
    alone, _ = posterior_mixture(logp[[0, 2]])
    assert torch.allclose(mix, alone, atol=1e-12)


def test_a_token_every_expert_calls_impossible_makes_the_rest_minus_inf_not_nan():
    logp = random_logp(2, 5, seed=6)
    logp[:, 2] = -math.inf
    mix, log_w = posterior_mixture(logp)
    assert not torch.isnan(mix).any() and not torch.isnan(log_w).any()
    assert (mix[2:] == -math.inf).all() and (log_w[:, 3:] == -math.inf).all()
    assert torch.isfinite(mix[:2]).all()


def test_uniform_mixture_averages_probabilities():
    logp = random_logp(3, 7, seed=7)
    want = logp.exp().mean(dim=0).log()
    assert torch.allclose(uniform_mixture(logp), want, atol=1e-12)


@pytest.mark.parametrize("logp, prior", [
    (torch.zeros(3), None),
    (torch.zeros(0, 4), None),
    (torch.zeros(2, 3, dtype=torch.long), None),
    (torch.tensor([[0.0, float("nan")]]), None),
    (torch.tensor([[0.0, math.inf]]), None),
    (torch.zeros(2, 3), torch.zeros(3)),
    (torch.zeros(2, 3), torch.tensor([0.0, float("nan")])),
    (torch.zeros(2, 3), torch.tensor([0.0, math.inf])),
    (torch.zeros(2, 3), torch.tensor([-math.inf, -math.inf])),
])
def test_bad_shapes_and_priors_are_value_errors(logp, prior):
    with pytest.raises(ValueError, match="logp|prior"):
        posterior_mixture(logp, prior)


def test_weights_over_the_experts_that_answered_are_renormalized():
    post = Posterior(["a", "b", "c"], {"a": math.log(0.5), "b": math.log(0.3), "c": math.log(0.2)})
    assert post.weights() == pytest.approx({"a": 0.5, "b": 0.3, "c": 0.2})
    assert post.weights(["b", "c"]) == pytest.approx({"b": 0.6, "c": 0.4})
    assert post.weights({"c"}) == pytest.approx({"c": 1.0})
    with pytest.raises(ValueError, match="no expert answered"):
        post.weights([])
    with pytest.raises(ValueError, match="not experts"):
        post.weights(["a", "z"])


def test_mix_without_an_expert_uses_the_renormalized_weights_of_the_others():
    post = Posterior(["a", "b", "c"], {"a": math.log(0.5), "b": math.log(0.3), "c": math.log(0.2)})
    logp = random_logp(3, 8, seed=8)
    got = post.mix({"a": logp[0], "c": logp[2]})
    want, _ = posterior_mixture(logp[[0, 2]], torch.tensor([0.5, 0.2], dtype=torch.float64).log())
    assert torch.allclose(got, want, atol=1e-12)
    assert post.answered_last == ["a", "c"]


def test_an_expert_that_misses_a_block_keeps_its_share_and_the_others_split_the_rest():
    post = Posterior(["a", "b", "c"])
    logp = random_logp(3, 16, seed=9)
    post.mix({"a": logp[0], "b": logp[1]})
    w = post.weights()
    assert w["c"] == pytest.approx(1 / 3, abs=1e-12)
    ab = posterior_mixture(logp[:2])[1]  # a and b alone, before their last token ...
    last = torch.log_softmax(ab[:, -1] + logp[:2, -1], dim=0).exp()  # ... and after it
    assert w["a"] == pytest.approx(2 / 3 * last[0].item(), abs=1e-9)
    assert w["b"] == pytest.approx(2 / 3 * last[1].item(), abs=1e-9)


@settings(max_examples=25, deadline=None)
@given(experts=st.integers(1, 4), cuts=st.lists(st.integers(0, 30), max_size=4), seed=st.integers(0, 2**16))
def test_mix_block_by_block_equals_posterior_mixture_over_the_whole_text(experts, cuts, seed):
    logp = random_logp(experts, 30, seed)
    names = [f"e{i}" for i in range(experts)]
    prior = torch.linspace(-1.0, 0.5, experts, dtype=torch.float64)
    post = Posterior(names, dict(zip(names, prior.tolist())))
    bounds = [0, *sorted(cuts), 30]
    pieces = [post.mix({n: logp[i, a:b] for i, n in enumerate(names)}) for a, b in zip(bounds, bounds[1:])]
    whole, log_w = posterior_mixture(logp, prior)
    assert torch.allclose(torch.cat(pieces), whole, atol=1e-9)
    final = torch.log_softmax(log_w[:, -1] + logp[:, -1], dim=0)
    assert torch.allclose(torch.tensor(list(post.log_weights.values()), dtype=torch.float64), final, atol=1e-9)


def test_mix_returns_the_inputs_dtype_and_refuses_bad_blocks_without_changing():
    post = Posterior(["a", "b"])
    out = post.mix({"a": torch.full((3,), -1.0), "b": torch.full((3,), -2.0)})
    assert out.dtype == torch.float32
    before = post.log_weights
    for bad in ({}, {"z": torch.zeros(2)}, {"a": torch.zeros(2), "b": torch.zeros(3)},
                {"a": torch.zeros(2, 2)}, {"a": torch.tensor([float("nan")])}):
        with pytest.raises(ValueError):
            post.mix(bad)
    assert post.log_weights == before and post.answered_last == ["a", "b"]


def test_an_expert_turned_off_by_the_prior_cannot_be_mixed_alone():
    post = Posterior(["a", "b"], {"a": 0.0, "b": -math.inf})
    with pytest.raises(ValueError, match="weight zero"):
        post.mix({"b": torch.zeros(2)})
    with pytest.raises(ValueError, match="weight zero"):
        post.weights(["b"])
    assert post.weights() == {"a": 1.0, "b": 0.0}


def test_posterior_refuses_bad_experts_and_priors():
    with pytest.raises(ValueError, match="experts"):
        Posterior([])
    with pytest.raises(ValueError, match="distinct"):
        Posterior(["a", "a"])
    with pytest.raises(ValueError, match="names every expert"):
        Posterior(["a", "b"], {"a": 0.0})
    with pytest.raises(ValueError, match="prior"):
        Posterior(["a", "b"], {"a": -math.inf, "b": -math.inf})


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 6), e=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_estimate_prior_is_a_log_distribution_and_the_mean_of_the_weights(n, e, seed):
    g = torch.Generator().manual_seed(seed)
    final = torch.log_softmax(torch.randn(n, e, generator=g) * 5, dim=1)
    prior = estimate_prior(final)
    assert prior.shape == (e,)
    assert prior.exp().sum().item() == pytest.approx(1.0, abs=1e-6)
    assert torch.allclose(prior.exp(), final.exp().mean(dim=0), atol=1e-6)


def test_estimate_prior_gives_minus_inf_to_an_expert_no_sequence_chose_and_refuses_bad_input():
    final = torch.tensor([[0.0, -math.inf], [0.0, -math.inf]])
    assert estimate_prior(final).tolist() == [0.0, -math.inf]
    for bad in (torch.zeros(3), torch.zeros(0, 2), torch.tensor([[-math.inf, -math.inf]]),
                torch.tensor([[0.0, float("nan")]])):
        with pytest.raises(ValueError):
            estimate_prior(bad)
