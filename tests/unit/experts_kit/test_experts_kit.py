"""The expert-ensemble experiment kit: text domains, the byte LM, flow matching, k-means and metrics."""

import math
import re

import pytest
import torch

from experts import ddm

from meshd.testing import experts_kit as ek


@pytest.fixture
def licenses(tmp_path, monkeypatch):
    """A licenses directory of three files (written out of order) and a link to one of them."""
    root = tmp_path / "licenses"
    root.mkdir()
    for name, char in (("c", "z"), ("a", "x"), ("b", "y")):
        (root / name).write_text(char * 10_000)
    (root / "d").symlink_to(root / "a")
    monkeypatch.setattr(ek, "LICENSES_DIR", root)
    return root


def test_domain_text_reads_files_in_sorted_order_once_each_and_stops_at_max_chars(licenses):
    assert ek.domain_text("licenses") == "x" * 10_000 + "y" * 10_000 + "z" * 10_000  # link d skipped
    assert ek.domain_text("licenses", max_chars=25_000) == "x" * 10_000 + "y" * 10_000 + "z" * 5_000


def test_splits_are_deterministic_disjoint_and_cover_the_text_80_10_10(licenses):
    first, again = ek.splits("licenses"), ek.splits("licenses")
    assert all(torch.equal(first[k], again[k]) for k in ("train", "dev", "test"))
    assert [len(first[k]) for k in ("train", "dev", "test")] == [24_000, 3_000, 3_000]
    joined = torch.cat([first["train"], first["dev"], first["test"]])
    assert torch.equal(joined, ek.encode(ek.domain_text("licenses")))  # contiguous, no byte in two parts


def test_domain_text_errors_naming_a_missing_directory(tmp_path, monkeypatch):
    missing = tmp_path / "no-man-pages"
    monkeypatch.setattr(ek, "MAN1_DIR", missing)
    with pytest.raises(RuntimeError, match=re.escape(str(missing))):
        ek.domain_text(ek.EVAL_DOMAIN)


def test_domain_text_errors_naming_a_directory_with_almost_no_text(tmp_path, monkeypatch):
    (tmp_path / "tiny").write_text("just a little")
    monkeypatch.setattr(ek, "LICENSES_DIR", tmp_path)
    with pytest.raises(RuntimeError, match=re.escape(str(tmp_path))):
        ek.domain_text("licenses")


def test_unknown_domain_is_a_value_error():
    with pytest.raises(ValueError, match="unknown domain"):
        ek.domain_text("poetry")


def test_dpkg_domains_read_their_own_files_in_sorted_order(tmp_path, monkeypatch):
    info = tmp_path / "info"
    info.mkdir()
    for name, char in (("b.postinst", "p"), ("a.prerm", "r"), ("a.list", "l"), ("b.list", "m"), ("a.symbols", "s"),
                       ("a.md5sums", "h"), ("a.preinst", "i")):
        (info / name).write_text(char * 10_000)
    (tmp_path / "status").write_text("S" * 25_000)
    monkeypatch.setattr(ek, "DPKG_INFO_DIR", info)
    monkeypatch.setattr(ek, "DPKG_STATUS", tmp_path / "status")
    assert ek.domain_text("filelists") == "l" * 10_000 + "m" * 10_000
    assert ek.domain_text("scripts") == "i" * 10_000 + "r" * 10_000 + "p" * 10_000  # by path, md5sums not read
    assert ek.domain_text("symbols", max_chars=10_000) == "s" * 10_000
    assert ek.domain_text("status") == "S" * 25_000
    monkeypatch.setattr(ek, "DPKG_STATUS", tmp_path / "no-status")
    with pytest.raises(RuntimeError, match=re.escape(str(tmp_path))):
        ek.domain_text("status")


def test_every_survey_domain_is_known():
    for name in ek.SURVEY_DOMAINS:
        try:
            ek.domain_text(name, max_chars=1_000)
        except RuntimeError:  # not on this machine: a clear error, not an unknown name
            pass


def test_encode_gives_the_utf8_bytes():
    assert ek.encode("aé").tolist() == [97, 0xC3, 0xA9]


def test_charlm_logits_have_shape_batch_time_vocab():
    model = ek.CharLM(width=16, layers=2, seed=0)
    assert model(torch.randint(256, (3, 7))).shape == (3, 7, ek.VOCAB)
    assert ek.param_count(model) == sum(p.numel() for p in model.parameters()) > 0


def test_token_logprobs_equal_a_direct_log_softmax_gather_across_windows():
    model = ek.CharLM(width=16, layers=2, seed=1)
    ids = ek.encode("def f(x):\n    return x + 1\n")
    direct = torch.log_softmax(model(ids[None, :-1])[0], -1).gather(1, ids[1:, None])[:, 0]
    windowed = ek.token_logprobs(model, ids, window=5)  # several windows, hidden state carried
    assert windowed.shape == (len(ids) - 1,)
    assert torch.allclose(windowed, direct, atol=1e-5)


def test_bpc_of_a_uniform_model_is_8_bits():
    model = ek.CharLM(width=8, layers=1)
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.zero_()
    assert ek.bpc(ek.token_logprobs(model, ek.encode("any text at all"))) == pytest.approx(8.0)


def test_branch_is_an_independent_copy():
    seed_model = ek.CharLM(width=8, layers=1)
    copy = ek.branch(seed_model)
    with torch.no_grad():
        next(copy.parameters()).add_(1.0)
    assert not torch.equal(next(copy.parameters()), next(seed_model.parameters()))


def test_grid_gaussians_sit_on_a_grid_centred_at_zero():
    x = ek.grid_gaussians(4000, seed=0, grid=4, std=0.01, spacing=1.0)
    assert x.shape == (4000, 2)
    assert torch.equal(x, ek.grid_gaussians(4000, seed=0, grid=4, std=0.01, spacing=1.0))
    assert torch.allclose(torch.sort(torch.unique(torch.round(x[:, 0] * 2) / 2)).values,
                          torch.tensor([-1.5, -0.5, 0.5, 1.5]))
    assert x.mean(0).abs().max() < 0.1


def test_kmeans_recovers_four_well_separated_clusters():
    x = ek.grid_gaussians(400, seed=3, grid=2, std=0.05, spacing=4.0)
    truth = ((x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long())
    assign, centres = ek.kmeans(x, 4, seed=0)
    pairs = {(int(t), int(a)) for t, a in zip(truth, assign)}
    assert len(pairs) == 4 and len({a for _, a in pairs}) == 4  # one cluster per true component
    grid = torch.tensor([[-2.0, -2.0], [-2.0, 2.0], [2.0, -2.0], [2.0, 2.0]])
    assert torch.cdist(centres, grid).min(1).values.max() < 0.05
    again = ek.kmeans(x, 4, seed=0)
    assert torch.equal(again[0], assign) and torch.equal(again[1], centres)


def test_interpolation_runs_from_noise_at_0_to_data_at_1_along_the_target_velocity():
    x0, x1 = torch.randn(5, 3), torch.randn(5, 3)
    assert torch.allclose(ddm.interpolate(x0, x1, torch.zeros(5)), x0)
    assert torch.allclose(ddm.interpolate(x0, x1, torch.ones(5)), x1)
    t = torch.rand(5)
    assert torch.allclose(ddm.interpolate(x0, x1, t) + (1 - t)[:, None] * ddm.target_velocity(x0, x1), x1, atol=1e-6)


def test_euler_with_the_true_velocity_carries_noise_to_a_fixed_x1_exactly():
    x1 = torch.tensor([[2.0, -1.0]]).expand(6, 2)
    seen, times = [], []

    def velocity(x, t):  # x1 − x0, with x0 recovered from x_t on the straight path
        seen.append(x.clone())
        times.append(float(t[0]))
        x0 = (x - t[:, None] * x1) / (1 - t[:, None])
        return ddm.target_velocity(x0, x1)

    out = ek.sample_flow(velocity, 6, 2, steps=8, seed=0)
    assert times == [i / 8 for i in range(8)]
    assert torch.allclose(seen[0], torch.randn(6, 2, generator=torch.Generator().manual_seed(0)))
    for x, t in zip(seen, times):  # every step lands on x_t = (1 − t)·x0 + t·x1
        assert torch.allclose(x, ddm.interpolate(seen[0], x1, torch.full((6,), t)), atol=1e-5)
    assert torch.allclose(out, x1, atol=1e-5)


def test_mmd_of_a_set_with_itself_is_about_zero_and_of_far_apart_clouds_is_large():
    x = torch.randn(300, 2, generator=torch.Generator().manual_seed(0))
    same, far = ek.mmd(x, x), ek.mmd(x + 20.0, x)  # one kernel: the default bandwidths, scaled by x
    assert far > 2.0  # the within-set terms, about E k each; the cross terms vanish
    assert abs(same) < 0.01 * far  # −2(mean k − k(a, a))/(N − 1): zero up to O(1/N)


_SIGMAS = (0.5, 2.0)


def _kernel(a, b):
    """The sum of RBF kernels of widths _SIGMAS, in float64: the reference the MMD tests compare with."""
    d2 = torch.cdist(a.double(), b.double()).square()
    return sum(torch.exp(-d2 / (2 * s * s)) for s in _SIGMAS)


def test_mmd_in_chunks_equals_the_unbiased_formula():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(50, 3, generator=gen), torch.randn(40, 3, generator=gen) + 0.5
    sigmas, k = _SIGMAS, _kernel
    kxx, kyy = k(x, x), k(y, y)
    want = ((kxx.sum() - kxx.trace()) / (50 * 49) + (kyy.sum() - kyy.trace()) / (40 * 39)
            - 2 * k(x, y).mean())
    assert ek.mmd(x, y, bandwidths=sigmas, scale=1.0, chunk=7) == pytest.approx(float(want), abs=1e-6)


def test_each_trainer_runs_one_step_and_the_router_gives_a_logit_per_expert():
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(64, 2, generator=gen)
    clusters = (data[:, 0] > 0).long()
    velocity, router = ek.VelocityMLP(2, width=16, depth=2), ek.RouterMLP(2, 2, width=16, depth=2)
    assert len(ek.train_flow(velocity, data, 1, batch=8)) == 1
    assert len(ek.train_router(router, data, clusters, 1, batch=8)) == 1
    assert router(data[:5], torch.rand(5)).shape == (5, 2)
    lm = ek.CharLM(width=8, layers=1)
    losses = ek.train_lm(lm, ek.encode("abc" * 40), 1, seq=16, batch=2)
    assert len(losses) == 1 and math.isfinite(losses[0])


def test_trainers_are_deterministic_given_their_seeds():
    data = torch.randn(64, 2, generator=torch.Generator().manual_seed(0))
    runs = [ek.train_flow(ek.VelocityMLP(2, width=16, depth=1, seed=4), data, 3, batch=8, seed=5) for _ in range(2)]
    assert runs[0] == runs[1]


def test_the_biased_mmd_keeps_the_diagonals_is_never_negative_and_has_a_positive_floor():
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(50, 3, generator=gen), torch.randn(40, 3, generator=gen) + 0.5
    sigmas, k = _SIGMAS, _kernel
    want = k(x, x).mean() + k(y, y).mean() - 2 * k(x, y).mean()
    assert ek.mmd(x, y, bandwidths=sigmas, scale=1.0, chunk=7, biased=True) == pytest.approx(float(want), abs=1e-9)
    assert ek.mmd(x, x, biased=True) == 0.0
    a, b = ek.grid_gaussians(800, seed=1), ek.grid_gaussians(800, seed=2)  # two draws of one distribution
    floor = ek.grid_mmd(a, b)
    assert 0 < floor < 4 / 800  # about (1/N + 1/M)(k(a, a) − E k) = (2/800)(1 − E k)
    assert ek.grid_mmd(a, ek.grid_gaussians(800, seed=3, std=0.15)) > 5 * floor  # modes three times too wide


def test_the_grid_velocity_is_exact_at_t0_and_carries_noise_onto_the_modes():
    x = torch.randn(64, 2, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(ek.grid_velocity(x, 0.0), -x, atol=1e-6)  # the modes' mean (0) minus x
    one = torch.zeros(16, dtype=torch.bool)
    one[5] = True
    assert torch.allclose(ek.grid_velocity(x, 0.0, modes=one), ek.grid_centres()[5] - x, atol=1e-6)
    held = ek.grid_gaussians(600, seed=1)
    out = ek.sample_flow(ek.grid_velocity, 600, 2, 100, seed=3)
    assert ek.grid_mmd(out, held) < 2 * ek.grid_mmd(ek.grid_gaussians(600, seed=2), held)


def test_the_exact_grid_router_is_the_prior_at_t0_and_knows_the_cluster_at_the_end():
    mode_clusters = torch.tensor([0, 0, 1, 1] * 4)  # by the sign of the second coordinate
    centres = ek.grid_centres()
    at_zero = ek.grid_cluster_logits(torch.randn(8, 2), 0.0, mode_clusters, 2)
    assert torch.allclose(at_zero[:, 0], at_zero[:, 1])  # 8 modes each, equally likely
    near_end = ek.grid_cluster_logits(0.99 * centres, torch.full((16,), 0.99), mode_clusters, 2)
    assert torch.equal(near_end.argmax(1), mode_clusters)
    assert ek.grid_cluster_logits(centres, 1.0, torch.zeros(16, dtype=torch.long), 2)[:, 1].eq(-math.inf).all()
