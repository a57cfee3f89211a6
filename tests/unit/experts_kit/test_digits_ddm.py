"""The digits DDM run's pieces: the data split, the classifier, class coverage, and DDM training on any data."""

import math

import pytest
import torch

from meshd.testing import digits as dg
from meshd.testing import experts_kit as ek


def test_coverage_counts_classes_with_half_their_fair_share_and_the_entropy_in_bits():
    labels = torch.tensor([0] * 50 + [1] * 30 + [2] * 12 + [3] * 8)
    c = dg.coverage(labels, classes=5)  # fair share 20, half of it 10; class 4 gets nothing
    assert c["counts"] == [50, 30, 12, 8, 0]
    assert c["covered"] == 3  # 8 < 10 misses
    shares = (0.5, 0.3, 0.12, 0.08)
    assert c["entropy"] == pytest.approx(-sum(p * math.log2(p) for p in shares))
    assert (c["max_share"], c["min_share"]) == (0.5, 0.0)
    assert dg.coverage(labels, classes=5, fair=0.7)["covered"] == 2  # 12 < 14 misses too


def test_coverage_of_even_labels_is_full_and_of_one_class_is_zero_bits():
    even = dg.coverage(torch.arange(10).repeat(7))
    assert (even["covered"], even["max_share"], even["min_share"]) == (10, 0.1, 0.1)
    assert even["entropy"] == pytest.approx(math.log2(10))
    one = dg.coverage(torch.full((40,), 3))
    assert (one["covered"], one["entropy"], one["max_share"]) == (1, 0.0, 1.0)


@pytest.mark.parametrize("labels", [torch.tensor([0, 10]), torch.tensor([-1, 2]), torch.tensor([], dtype=torch.long)])
def test_coverage_refuses_labels_outside_the_classes_or_none(labels):
    with pytest.raises(ValueError):
        dg.coverage(labels)


def test_digits_data_is_a_deterministic_disjoint_split_scaled_to_minus_one_one():
    d, again = dg.digits_data(), dg.digits_data()
    assert all(torch.equal(d[k], again[k]) for k in d)
    assert [tuple(d[k].shape) for k in ("train", "held", "held2")] == [(1197, 64), (300, 64), (300, 64)]
    assert [len(d[k]) for k in ("train_y", "held_y", "held2_y")] == [1197, 300, 300]
    x = torch.cat([d["train"], d["held"], d["held2"]])
    assert float(x.min()) == -1.0 and float(x.max()) == 1.0
    train01, _, test01, _ = dg.digits()  # the same order as digits(), rescaled: every image in one part, once
    assert torch.equal(x, 2 * torch.cat([train01, test01]) - 1)
    assert set(d["held_y"].tolist()) == set(range(10))
    small = dg.digits_data(held=100)
    assert [len(small[k]) for k in ("train", "held", "held2")] == [1597, 100, 100]
    with pytest.raises(ValueError):
        dg.digits_data(held=900)


def test_the_digit_classifier_labels_held_out_digits_well():
    d = dg.digits_data()
    classify = dg.digit_classifier(d["train"], d["train_y"])
    predicted = classify(d["held"])
    assert predicted.dtype == torch.long and predicted.shape == (300,)
    assert float((predicted == d["held_y"]).float().mean()) > 0.9


def test_train_ddm_on_any_dimension_gives_an_expert_per_cluster_a_router_and_the_monolith():
    gen = torch.Generator().manual_seed(0)
    train = torch.cat([torch.randn(40, 5, generator=gen) - 4, torch.randn(40, 5, generator=gen) + 4])
    held, held2 = torch.randn(20, 5, generator=gen), torch.randn(20, 5, generator=gen)
    m = ek.train_ddm_on(train, held, held2, 1, clusters=2, width=8, monolith_width=12)
    assert m["dim"] == 5 and m["steps"] == 1 and len(m["experts"]) == 2
    assert sorted(torch.bincount(m["assign"]).tolist()) == [40, 40]  # the two blobs
    assert m["router"](held, torch.rand(20)).shape == (20, 2)
    assert m["experts"][0](held, torch.rand(20)).shape == (20, 5)
    assert m["params"] == (ek.param_count(m["experts"][0]), ek.param_count(m["monolith"]))
    assert m["floor"] == ek.mmd(held2, held) and m["held"] is held and m["held2"] is held2
    assert ek.train_ddm_on(train, held, held2, 1, clusters=2, width=8)["monolith"] is None


def test_train_ddm_takes_a_seed_a_recipe_and_a_distance_and_says_each_modes_cluster():
    calls = []

    def distance(x, y):
        calls.append((len(x), len(y)))
        return 0.5

    m = ek.train_ddm(2, 30, seed=1, lr=1e-3, decay=0.5, router_steps=3, distance=distance)
    assert m["floor"] == 0.5 and m["distance"] is distance and calls == [(30, 30)]
    assert torch.equal(m["held"], ek.grid_gaussians(30, seed=11))  # seed 1: data seeds 10, 11, 12
    assert m["centres"].shape == (4, 2) and m["mode_clusters"].shape == (16,)
    assert sorted(torch.bincount(m["mode_clusters"], minlength=4).tolist()) == [4, 4, 4, 4]  # the quadrants
    first = ek.train_ddm(2, 30)
    assert torch.equal(first["held"], ek.grid_gaussians(30, seed=1))  # seed 0: the seeds earlier versions used
    assert not torch.equal(first["experts"][0].net[0].weight, m["experts"][0].net[0].weight)
