"""The experiment kit for decentralized expert ensembles: data, small models, trainers and metrics.

Two families of experiments use it, both in plain torch so that a benchmark or
an example can compute the in-process reference (the ceiling) that the served,
networked ensemble is measured against:

* **HDEE** (heterogeneous domain expert ensembles of language models).  Byte-
  level text from files any Debian machine has: Python's standard library
  (``code``), ``/usr/share/common-licenses`` (``licenses``), Debian changelogs
  (``changelogs``), and man pages (``manpages``, held out for evaluation);
  and more, from dpkg's own database and the files every package ships
  (:data:`SURVEY_DOMAINS`), for experiments that need domains of different
  difficulty.  A
  small GRU language model over bytes (:class:`CharLM`), a trainer, per-byte
  log-probabilities and bits per character.  A seed model is trained once and
  :func:`branch`-ed per domain for continued training.

* **DDM** (decentralized diffusion models, here flow matching).  A grid of
  Gaussians in 2-D, k-means to partition the data into clusters (one expert
  each), a velocity MLP, a router MLP, trainers, an Euler sampler, MMD, and
  :func:`train_ddm_on`, the whole setup on any data, which the benchmark and
  the example use on the grid (:func:`train_ddm`) and the benchmark on
  scikit-learn's digits (``meshd.testing.digits``).

* **Experts in a process of their own** (:func:`expert_process`): a child
  process whose meshd node serves kit models (:class:`ExpertSpec`: a builder
  in :data:`BUILDERS` and its weights), so a benchmark or a test can SIGKILL
  an expert's server by its pid, as a crashed or killed machine looks.

Flow-matching convention, used by every function here: noise x0 ~ N(0, I) at
t = 0, data x1 at t = 1, x_t = (1 − t)·x0 + t·x1, target velocity x1 − x0;
sampling integrates with Euler from t = 0 to 1 in ``steps`` steps of
dt = 1/steps, evaluating the velocity at t = i/steps for i in range(steps).

Everything is deterministic given its ``seed``: models are initialised from
their own seed without touching torch's global generator, and trainers draw
batches from a private :class:`torch.Generator`.  The text domains are read in
sorted path order, so they are the same on every run on the same machine (but
not across machines: package sets and Python versions differ).
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import json
import math
import os
import signal
import subprocess
import sys
import sysconfig
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import trio

from experts.training import fit, kmeans, train_flow, train_router

__all__ = [
    "BUILDERS", "CHANGELOG_GLOB", "DOC_DIR", "DOMAINS", "DPKG_INFO_DIR", "DPKG_STATUS", "EVAL_DOMAIN", "GRID_MMD_SIGMA",
    "LICENSES_DIR", "MAN1_DIR", "MIN_CHARS", "MMD_BANDWIDTHS", "PERL_BASE_DIR", "STDLIB_DIR", "SURVEY_DOMAINS", "VOCAB",
    "CharLM", "ExpertProcess", "ExpertSpec", "RouterMLP", "VelocityMLP",
    "bpc", "branch", "domain_text", "encode", "expert_process",
    "grid_centres", "grid_cluster_logits", "grid_gaussians", "grid_mmd", "grid_velocity", "kmeans",
    "median_distance", "mlp", "mmd", "param_count", "sample_flow", "splits", "time_features",
    "token_logprobs", "train_ddm", "train_ddm_on", "train_flow", "train_lm", "train_router",
]

# --------------------------------------------------------------------------- text domains (HDEE)

DOMAINS = ("code", "licenses", "changelogs")
"""The domains experts are trained on."""
EVAL_DOMAIN = "manpages"
"""The domain held out for evaluation only."""
SURVEY_DOMAINS = ("code", "licenses", "changelogs", "filelists", "status", "scripts", "copyright", "perl", "symbols")
"""Every domain experts may be trained on (:func:`domain_text` says what each is): text from packages
every Debian system has (dpkg, perl-base, base-files, the Python running this) or from files every
package ships; an experiment that needs domains of different difficulty picks among them."""

# Where each domain's files live; module-level so tests can point them elsewhere.
STDLIB_DIR = Path(sysconfig.get_paths()["stdlib"])
LICENSES_DIR = Path("/usr/share/common-licenses")
DOC_DIR = Path("/usr/share/doc")
CHANGELOG_GLOB = "*/changelog.Debian.gz"
MAN1_DIR = Path("/usr/share/man/man1")
DPKG_INFO_DIR = Path("/var/lib/dpkg/info")
DPKG_STATUS = Path("/var/lib/dpkg/status")
PERL_BASE_DIR = Path("/usr/lib") / sysconfig.get_config_var("MULTIARCH") / "perl-base" \
    if sysconfig.get_config_var("MULTIARCH") else Path("/usr/lib/perl-base")

MIN_CHARS = 20_000
"""A domain with fewer characters than this (or than ``max_chars``, if smaller) is an error."""

VOCAB = 256
"""The vocabulary: the 256 byte values of UTF-8 text; no tokenizer."""


def _files(directory: Path, pattern: str) -> list[Path]:
    """Regular files under ``directory`` matching ``pattern``, sorted by path, each real file once
    (a symlink to a file already listed, such as common-licenses/GPL -> GPL-3, is skipped)."""
    seen: set[Path] = set()
    out = []
    for path in sorted(directory.glob(pattern)):
        try:
            real = path.resolve(strict=True)
        except (OSError, RuntimeError):  # dangling or looping link
            continue
        if real.is_file() and real not in seen:
            seen.add(real)
            out.append(path)
    return out


def _read(path: Path, chars: int, compressed: bool) -> str:
    """At most ``chars`` characters from the start of ``path`` (UTF-8, undecodable bytes as U+FFFD).

    Reads at most 4·chars bytes: enough for ``chars`` characters, since a UTF-8
    character takes at most 4 bytes and a character cut at the end of the read
    lies past the first ``chars``."""
    opener = gzip.open if compressed else open
    try:
        with opener(path, "rb") as f:
            raw = f.read(4 * chars)
    except (OSError, EOFError):  # unreadable or corrupt file: skip it
        return ""
    return raw.decode("utf-8", errors="replace")[:chars]


def _sources(name: str) -> tuple[Path, list[Path], bool]:
    """The directory a domain comes from, its files in reading order, and whether they are gzipped."""
    if name == "code":
        return STDLIB_DIR, _files(STDLIB_DIR, "*.py"), False
    if name == "licenses":
        return LICENSES_DIR, _files(LICENSES_DIR, "*"), False
    if name == "changelogs":
        return DOC_DIR, _files(DOC_DIR, CHANGELOG_GLOB), True
    if name == "manpages":
        return MAN1_DIR, _files(MAN1_DIR, "*.gz"), True
    if name == "filelists":
        return DPKG_INFO_DIR, _files(DPKG_INFO_DIR, "*.list"), False
    if name == "status":
        return DPKG_STATUS.parent, [DPKG_STATUS] if DPKG_STATUS.is_file() else [], False
    if name == "scripts":
        scripts = [p for kind in ("preinst", "postinst", "prerm", "postrm")
                   for p in _files(DPKG_INFO_DIR, f"*.{kind}")]
        return DPKG_INFO_DIR, sorted(scripts), False
    if name == "copyright":
        return DOC_DIR, _files(DOC_DIR, "*/copyright"), False
    if name == "perl":
        return PERL_BASE_DIR, _files(PERL_BASE_DIR, "**/*.pm"), False
    if name == "symbols":
        return DPKG_INFO_DIR, _files(DPKG_INFO_DIR, "*.symbols"), False
    raise ValueError(f"unknown domain {name!r}; known: {', '.join((*SURVEY_DOMAINS, EVAL_DOMAIN))}")


def domain_text(name: str, max_chars: int = 400_000) -> str:
    """The first ``max_chars`` characters of domain ``name``: its files concatenated in sorted path order.

    * ``code``: the Python standard library's top-level ``*.py`` files
      (:data:`STDLIB_DIR`, from ``sysconfig``; subpackages and site-packages are not read);
    * ``licenses``: every file in :data:`LICENSES_DIR`;
    * ``changelogs``: :data:`DOC_DIR`/``*/changelog.Debian.gz``, gunzipped;
    * ``manpages`` (:data:`EVAL_DOMAIN`): :data:`MAN1_DIR`/``*.gz``, gunzipped, roff markup as is;
    * ``filelists``: the paths each installed package put on the system, :data:`DPKG_INFO_DIR`/``*.list``;
    * ``status``: dpkg's package records, :data:`DPKG_STATUS` (one file);
    * ``scripts``: packages' maintainer scripts (shell, mostly), :data:`DPKG_INFO_DIR`/``*.preinst``,
      ``*.postinst``, ``*.prerm``, ``*.postrm``;
    * ``copyright``: :data:`DOC_DIR`/``*/copyright``, kept even where docs are trimmed;
    * ``perl``: perl-base's modules, :data:`PERL_BASE_DIR`/``**/*.pm``;
    * ``symbols``: shared libraries' symbol lists, :data:`DPKG_INFO_DIR`/``*.symbols`` (C and mangled C++ names
      with the versions that brought them).

    Files are decoded as UTF-8 with undecodable bytes replaced (U+FFFD); a file
    reached through several links is read once.  Raises ValueError for an
    unknown name and RuntimeError naming the directory when the domain has
    fewer than ``min(MIN_CHARS, max_chars)`` characters on this machine (a
    missing directory, or a slim image that drops docs or man pages).
    """
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, not {max_chars}")
    directory, files, compressed = _sources(name)
    parts: list[str] = []
    have = 0
    for path in files:
        if have >= max_chars:
            break
        part = _read(path, max_chars - have, compressed)
        parts.append(part)
        have += len(part)
    text = "".join(parts)
    if len(text) < min(MIN_CHARS, max_chars):
        raise RuntimeError(
            f"domain {name!r} has only {len(text):,} characters in {directory} on this machine "
            f"({len(files)} files); it needs at least {min(MIN_CHARS, max_chars):,}")
    return text


def encode(text: str) -> torch.Tensor:
    """``text`` as a LongTensor of its UTF-8 bytes (values 0 .. 255, so the vocabulary is :data:`VOCAB`)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def splits(name: str, max_chars: int = 400_000) -> dict[str, torch.Tensor]:
    """Domain ``name`` encoded (:func:`domain_text`, :func:`encode`) and cut into contiguous parts:
    ``train`` the first 80 % of the bytes, ``dev`` the next 10 %, ``test`` the rest.

    Contiguous cuts keep the parts disjoint in position (no window crosses
    from train into dev); the same on every call.  ``max_chars`` counts
    characters, so the byte count can be a little larger for non-ASCII text."""
    ids = encode(domain_text(name, max_chars))
    a, b = int(len(ids) * 0.8), int(len(ids) * 0.9)
    return {"train": ids[:a], "dev": ids[a:b], "test": ids[b:]}


class CharLM(torch.nn.Module):
    """A causal language model over bytes: embedding, a ``layers``-deep GRU of ``width`` units, a linear head.

    A GRU rather than a small transformer: on one CPU thread it reaches a far
    lower loss in the same tens of seconds (a training loss of about 1.2
    against 2.1 bits per byte after 200 steps on Python source, half a
    million parameters each, a 2-layer pre-norm transformer of width 128), and
    its hidden state lets :func:`token_logprobs` score long text exactly in
    windows.  Initialised from ``seed`` without touching the global generator.
    """

    def __init__(self, width: int = 128, layers: int = 1, *, seed: int = 0):
        super().__init__()
        if width <= 0 or layers <= 0:
            raise ValueError(f"width and layers must be positive, not {width} and {layers}")
        self.width, self.layers = width, layers
        self.init_kwargs = {"width": width, "layers": layers, "seed": seed}  # to build it again elsewhere
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = torch.nn.Embedding(VOCAB, width)
            self.rnn = torch.nn.GRU(width, width, layers, batch_first=True)
            self.head = torch.nn.Linear(width, VOCAB)

    def run(self, ids: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, T, 256] for ``ids`` [B, T] continuing from ``state`` (None: the start of the text),
        and the state after the last byte, [layers, B, width]."""
        out, state = self.rnn(self.embed(ids), state)
        return self.head(out), state

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, 256]: position i scores the byte after ``ids[:, :i + 1]``."""
        return self.run(ids)[0]


def param_count(model: torch.nn.Module) -> int:
    """The number of scalar parameters in ``model``."""
    return sum(p.numel() for p in model.parameters())


def train_lm(model: CharLM, data: torch.Tensor, steps: int, *, seq: int = 128, batch: int = 32,
             lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Trains ``model`` in place for ``steps`` AdamW steps of next-byte cross-entropy; the losses (nats).

    Each step takes ``batch`` windows of ``seq`` + 1 bytes at random offsets of
    ``data`` (a 1-D LongTensor), drawn from a generator seeded with ``seed``;
    gradients are clipped to norm 1.0.  A new optimizer per call, so a
    branched model starts its continued training with fresh moments."""
    if data.dim() != 1 or len(data) < seq + 2:
        raise ValueError(f"data must be 1-D with more than {seq + 1} bytes, not shape {tuple(data.shape)}")
    offsets = torch.arange(seq + 1)

    def loss(gen: torch.Generator) -> torch.Tensor:
        starts = torch.randint(len(data) - seq, (batch,), generator=gen)
        window = data[starts[:, None] + offsets]
        logits = model(window[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))

    return fit(model, steps, lr, seed, loss, clip=1.0)


@torch.no_grad()
def token_logprobs(model: CharLM, ids: torch.Tensor, *, window: int = 1024) -> torch.Tensor:
    """log p(ids[i + 1] | ids[:i + 1]) for i in 0 .. T − 2: a Tensor [T − 1] of natural logs.

    The sequence is fed in windows of at most ``window`` bytes with the GRU's
    hidden state carried from one window to the next, so every byte is
    conditioned on the whole text before it, exactly as one pass over the
    whole sequence would (up to float rounding), in bounded memory.  The first
    byte has no prediction.  Runs in eval mode without gradients."""
    if ids.dim() != 1:
        raise ValueError(f"ids must be one sequence (1-D), not shape {tuple(ids.shape)}")
    if len(ids) < 2:
        return torch.zeros(0)
    was_training = model.training
    model.eval()
    try:
        out, state = [], None
        inputs, targets = ids[:-1], ids[1:]
        for at in range(0, len(inputs), window):
            logits, state = model.run(inputs[None, at:at + window], state)
            logp = torch.log_softmax(logits[0].float(), -1)
            out.append(logp.gather(1, targets[at:at + window, None])[:, 0])
        return torch.cat(out)
    finally:
        model.train(was_training)


def bpc(logprobs: torch.Tensor) -> float:
    """Bits per character (per byte here): −mean(``logprobs``) / ln 2, from natural-log probabilities."""
    if logprobs.numel() == 0:
        raise ValueError("bpc of no predictions")
    return float(-logprobs.double().mean() / math.log(2))


def branch(seed_model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``seed_model`` to train on one domain, sharing nothing with the original."""
    return copy.deepcopy(seed_model)


# --------------------------------------------------------------------------- flow-matching data (DDM)

def grid_centres(grid: int = 4, spacing: float = 1.0) -> torch.Tensor:
    """The centres [grid², 2] of :func:`grid_gaussians`' modes, in the order it numbers them."""
    axis = (torch.arange(grid, dtype=torch.float32) - (grid - 1) / 2) * spacing
    return torch.cartesian_prod(axis, axis)


def grid_gaussians(n: int, seed: int, *, grid: int = 4, std: float = 0.05, spacing: float = 1.0) -> torch.Tensor:
    """``n`` points [n, 2] from an equal mixture of grid × grid Gaussians (std ``std``) whose centres
    form a square grid, ``spacing`` apart, centred at the origin (for grid 4, spacing 1: ±0.5, ±1.5)."""
    gen = torch.Generator().manual_seed(seed)
    centres = grid_centres(grid, spacing)
    which = torch.randint(grid * grid, (n,), generator=gen)
    return centres[which] + std * torch.randn(n, 2, generator=gen)


def _grid_posterior(x: torch.Tensor, t: torch.Tensor | float, std: float, centres: torch.Tensor):
    """For x_t = (1 − t)·x0 + t·x1, x0 ~ N(0, I), x1 from the grid: the log-likelihood of x_t
    under each mode (up to a constant shared by the modes) [B, M], t [B, 1] and the variance of
    x_t given the mode [B, 1], all in float64."""
    x = x.double()
    t = _times(t, len(x)).double()[:, None]
    var = (1 - t) ** 2 + (t * std) ** 2
    mus = centres.double()
    return -((x[:, None, :] - t[:, :, None] * mus[None]) ** 2).sum(-1) / (2 * var), t, var


def grid_velocity(x: torch.Tensor, t: torch.Tensor | float, *, modes: torch.Tensor | None = None,
                  grid: int = 4, std: float = 0.05, spacing: float = 1.0) -> torch.Tensor:
    """The exact flow-matching velocity E[x1 − x0 | x_t] at points ``x`` [B, 2] and times ``t``
    (a number, or [B]) of the flow from N(0, I) to :func:`grid_gaussians`' mixture, or to the
    part of it on the modes ``modes`` (a bool mask [grid²]: what a perfect expert of that
    cluster learns); float32 [B, 2].  Sampling with it shows what the sampler itself costs,
    with no model error.  Each mode is Gaussian, so given the mode x1 and x_t are jointly
    Gaussian: E[x1 − x0 | x_t, mode μ] = μ + (t·std² − (1 − t)) / var_t · (x_t − t·μ),
    var_t = (1 − t)² + t²·std², weighed by the modes' posteriors."""
    centres = grid_centres(grid, spacing)
    logl, t, var = _grid_posterior(x, t, std, centres)
    if modes is not None:
        logl = logl.masked_fill(~modes.bool()[None], -math.inf)
    w = torch.softmax(logl, 1)  # [B, M]
    mus = centres.double()
    x = x.double()
    per_mode = mus[None] + ((t * std * std - (1 - t)) / var)[:, :, None] * (x[:, None, :] - t[:, :, None] * mus[None])
    return (w[..., None] * per_mode).sum(1).float()


def grid_cluster_logits(x: torch.Tensor, t: torch.Tensor | float, mode_clusters: torch.Tensor, clusters: int, *,
                        grid: int = 4, std: float = 0.05, spacing: float = 1.0) -> torch.Tensor:
    """The exact router for :func:`grid_gaussians`: log p(k | x_t, t) up to a constant per row
    [B, clusters], mode m belonging to cluster ``mode_clusters[m]`` (every mode equally likely)."""
    logl, _, _ = _grid_posterior(x, t, std, grid_centres(grid, spacing))
    out = torch.full((len(x), clusters), -math.inf, dtype=torch.float64)
    for k in range(clusters):
        mine = mode_clusters == k
        if bool(mine.any()):
            out[:, k] = torch.logsumexp(logl[:, mine], 1)
    return out


# --------------------------------------------------------------------------- flow-matching models (DDM)

def time_features(t: torch.Tensor, count: int = 16) -> torch.Tensor:
    """Sinusoidal features of times ``t`` [B] in [0, 1]: [B, count], sin and cos of t·f for
    ``count`` / 2 frequencies f spaced geometrically from 1 to 100 (radians per unit time)."""
    if count % 2:
        raise ValueError(f"count must be even, not {count}")
    freqs = torch.logspace(0.0, 2.0, count // 2, dtype=torch.float32, device=t.device)
    angles = t.float()[:, None] * freqs
    return torch.cat([angles.sin(), angles.cos()], 1)


def _trunk(inputs: int, outputs: int, width: int, depth: int) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for i in range(depth):
        layers += [torch.nn.Linear(inputs if i == 0 else width, width), torch.nn.SiLU()]
    layers.append(torch.nn.Linear(width if depth else inputs, outputs))
    return torch.nn.Sequential(*layers)


def _times(t: torch.Tensor | float, rows: int) -> torch.Tensor:
    t = torch.as_tensor(t, dtype=torch.float32)
    return t.expand(rows) if t.dim() == 0 else t


class VelocityMLP(torch.nn.Module):
    """v(x_t, t) for flow matching: an MLP on [x_t, time_features(t)] with ``depth`` hidden layers
    of ``width`` SiLU units, output [B, dim].  Initialised from ``seed``."""

    def __init__(self, dim: int, width: int = 256, depth: int = 3, *, time_dim: int = 16, seed: int = 0):
        super().__init__()
        self.dim, self.time_dim = dim, time_dim
        self.init_kwargs = {"dim": dim, "width": width, "depth": depth, "time_dim": time_dim, "seed": seed}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.net = _trunk(dim + time_dim, dim, width, depth)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The velocity at points ``x`` [B, dim] and times ``t`` [B] (or one scalar time for all)."""
        return self.net(torch.cat([x, time_features(_times(t, len(x)), self.time_dim)], 1))


class RouterMLP(torch.nn.Module):
    """r(k | x_t, t): the same inputs as :class:`VelocityMLP`, ``experts`` logits out (which
    expert's cluster the clean point x1 came from).  Initialised from ``seed``."""

    def __init__(self, dim: int, experts: int, width: int = 256, depth: int = 3, *, time_dim: int = 16,
                 seed: int = 0):
        super().__init__()
        self.dim, self.experts, self.time_dim = dim, experts, time_dim
        self.init_kwargs = {"dim": dim, "experts": experts, "width": width, "depth": depth, "time_dim": time_dim,
                            "seed": seed}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.net = _trunk(dim + time_dim, experts, width, depth)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Logits [B, experts] at points ``x`` [B, dim] and times ``t`` [B] (or one scalar time)."""
        return self.net(torch.cat([x, time_features(_times(t, len(x)), self.time_dim)], 1))


@torch.no_grad()
def sample_flow(velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], n: int, dim: int, steps: int,
                seed: int) -> torch.Tensor:
    """``n`` samples [n, dim]: noise x ~ N(0, I) from a generator seeded with ``seed``, then
    ``steps`` Euler steps x += velocity(x, t)/steps at t = i/steps, i = 0 .. steps − 1.

    ``velocity(x, t_vec)`` takes the points [n, dim] and a time per row [n]."""
    if steps <= 0:
        raise ValueError(f"steps must be positive, not {steps}")
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    for i in range(steps):
        x = x + velocity(x, torch.full((n,), i / steps)) / steps
    return x


# --------------------------------------------------------------------------- metrics (DDM)

MMD_BANDWIDTHS = (0.1, 0.2, 0.5, 1.0, 2.0)
""":func:`mmd`'s default RBF bandwidths, as multiples of the reference's median pairwise distance."""


def median_distance(y: torch.Tensor, max_points: int = 1000) -> float:
    """The median Euclidean distance between distinct pairs of ``y``'s first ``max_points`` rows."""
    y = y[:max_points].double()
    if len(y) < 2:
        raise ValueError("a median distance needs at least two points")
    d = torch.cdist(y, y)
    i, j = torch.triu_indices(len(y), len(y), 1)
    return float(d[i, j].median())


def _kernel_sum(a: torch.Tensor, b: torch.Tensor, gammas: torch.Tensor, chunk: int) -> float:
    """Σ_ij Σ_s exp(−γ_s |a_i − b_j|²), computed ``chunk`` rows of ``a`` at a time."""
    total = 0.0
    for at in range(0, len(a), chunk):
        d2 = torch.cdist(a[at:at + chunk], b).square()
        for g in gammas.tolist():
            total += float(torch.exp(-g * d2).sum(dtype=torch.float64))
    return total


@torch.no_grad()
def mmd(x: torch.Tensor, y: torch.Tensor, *, bandwidths: Iterable[float] = MMD_BANDWIDTHS,
        scale: float | None = None, chunk: int = 1024, biased: bool = False) -> float:
    """Unbiased MMD² between samples ``x`` [N, D] and ``y`` [M, D] (N, M >= 2), or with
    ``biased`` the V-statistic.

    The kernel is a sum of RBFs k(a, b) = Σ_s exp(−|a − b|² / (2 σ_s²)) with
    σ_s = bandwidths[s] · ``scale``.  ``scale`` defaults to the median pairwise
    distance of ``y``'s first 1,000 rows (:func:`median_distance`), so pass the
    reference data as ``y`` and keep it fixed when comparing candidates; the
    default multiples (0.1, 0.2, 0.5, 1, 2) reach from well inside one mode to
    the spread of the whole set (for the 4 × 4 grid, whose median distance is
    about 1.7: σ from 0.17 to 3.4).  Pass ``bandwidths`` with ``scale=1.0``
    for absolute σ.  The estimate can be slightly negative when the two
    distributions are equal; mmd(x, x) itself is −2(mean k − k(a, a))/(N − 1),
    zero up to O(1/N).  With ``biased`` the within-set means keep their diagonals
    (mean over all N² and M² pairs, in float64): the squared RKHS distance between the
    two empirical mean embeddings, never negative (clamped at 0 against rounding), and
    of two samples of one distribution about (1/N + 1/M)(k(a, a) − E k) rather than
    zero, a floor that falls as the samples grow.  Pairwise distances go ``chunk``
    rows at a time, so 5,000 × 5,000 takes a few tens of MB."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[1] != y.shape[1] or len(x) < 2 or len(y) < 2:
        raise ValueError(f"need two sets of >= 2 rows of the same width, not {tuple(x.shape)}, {tuple(y.shape)}")
    if scale is None:
        scale = median_distance(y)
    sigmas = torch.tensor([float(b) * scale for b in bandwidths], dtype=torch.float64)
    if len(sigmas) == 0 or bool((sigmas <= 0).any()):
        raise ValueError(f"bandwidths must be positive, got σ = {sigmas.tolist()}")
    gammas = 1.0 / (2.0 * sigmas.square())
    if biased:
        x, y = x.double(), y.double()
        value = (_kernel_sum(x, x, gammas, chunk) / len(x) ** 2 + _kernel_sum(y, y, gammas, chunk) / len(y) ** 2
                 - 2.0 * _kernel_sum(x, y, gammas, chunk) / (len(x) * len(y)))
        return max(0.0, value)
    x, y = x.float(), y.float()
    n, m, diag = len(x), len(y), float(len(sigmas))  # k(a, a) = one per bandwidth
    kxx = (_kernel_sum(x, x, gammas, chunk) - n * diag) / (n * (n - 1))
    kyy = (_kernel_sum(y, y, gammas, chunk) - m * diag) / (m * (m - 1))
    kxy = _kernel_sum(x, y, gammas, chunk) / (n * m)
    return kxx + kyy - 2.0 * kxy


GRID_MMD_SIGMA = 0.1
""":func:`grid_mmd`'s kernel width: twice the grid's modes' std (0.05) and a tenth of their spacing (1),
so the distance sees each mode's place, weight and width, and any mass between the modes."""


def grid_mmd(x: torch.Tensor, y: torch.Tensor) -> float:
    """The benchmark's distance on the 4 × 4 grid: the biased (V-statistic) MMD² of one RBF
    kernel of fixed σ = :data:`GRID_MMD_SIGMA`, never negative, the same kernel whatever the
    samples (no median heuristic).  Its square root is the MMD, a distance."""
    return mmd(x, y, bandwidths=(GRID_MMD_SIGMA,), scale=1.0, biased=True)


def train_ddm_on(train: torch.Tensor, held: torch.Tensor, held2: torch.Tensor, steps: int, *, clusters: int = 4,
                 width: int = 256, monolith_width: int | None = None, seed: int = 0, lr: float = 2e-3,
                 decay: float = 0.0, router_steps: int | None = None,
                 distance: Callable[[torch.Tensor, torch.Tensor], float] | None = None) -> dict:
    """The DDM setup on any data [N, D], trained in this process (seeded): ``train`` cut by
    k-means into ``clusters``, one :class:`VelocityMLP` of ``width`` per cluster and a
    :class:`RouterMLP`, ``steps`` steps each (the router ``router_steps`` if given); with
    ``monolith_width``, one VelocityMLP that wide (pick it to match the experts' total
    parameters) trained ``clusters × steps`` steps on all of ``train``.  Every model trains
    at learning rate ``lr``, decayed over the last ``decay`` of its steps
    (:func:`experts.training.fit`).  ``seed`` 0 gives the seeds earlier versions used;
    another shifts every seed (k-means, each model's initialisation and batches) by
    100 × ``seed``.  Returns ``held``, ``held2``, ``floor`` (``distance`` between the two
    held-out sets, :func:`mmd` by default, and ``distance`` itself), ``experts``, ``router``,
    ``monolith`` (or None), ``params`` (one expert's, the monolith's), ``dim``, ``steps``,
    ``assign`` (each training row's cluster) and ``centres`` (the clusters')."""
    dim, shift = train.shape[1], 100 * seed
    distance = mmd if distance is None else distance
    assign, centres = kmeans(train, clusters, seed=seed)
    experts = []
    for k in range(clusters):
        expert = VelocityMLP(dim, width, seed=k + shift)
        train_flow(expert, train[assign == k], steps, seed=k + shift, lr=lr, decay=decay)
        experts.append(expert.eval())
    router = RouterMLP(dim, clusters, width, seed=9 + shift)
    train_router(router, train, assign, steps if router_steps is None else router_steps, seed=9 + shift, lr=lr,
                 decay=decay)
    mono = None
    if monolith_width:
        mono = VelocityMLP(dim, width=monolith_width, seed=7 + shift)
        train_flow(mono, train, clusters * steps, seed=7 + shift, lr=lr, decay=decay)
        mono.eval()
    return {"held": held, "held2": held2, "floor": distance(held2, held), "distance": distance, "experts": experts,
            "router": router.eval(), "monolith": mono,
            "params": (param_count(experts[0]), param_count(mono) if mono else None),
            "dim": dim, "steps": steps, "assign": assign, "centres": centres}


def train_ddm(steps: int, samples: int, *, clusters: int = 4, monolith: bool = False, seed: int = 0,
              **recipe) -> dict:
    """:func:`train_ddm_on` the 4 × 4 grid: 8000 training points, ``samples`` held-out points
    and as many more for the floor (drawn with seeds 10·``seed`` + 0, 1, 2); with ``monolith``,
    a monolith of width 512 (about 4 experts' parameters); ``recipe``: train_ddm_on's ``lr``,
    ``decay``, ``router_steps``, ``distance``.  Adds ``mode_clusters``: the cluster of each
    of the grid's modes (its centre's nearest cluster centre), for :func:`grid_cluster_logits`."""
    train, held, held2 = (grid_gaussians(n, seed=10 * seed + s) for n, s in ((8000, 0), (samples, 1), (samples, 2)))
    models = train_ddm_on(train, held, held2, steps, clusters=clusters, monolith_width=512 if monolith else None,
                          seed=seed, **recipe)
    models["mode_clusters"] = torch.cdist(grid_centres(), models["centres"]).argmin(1)
    return models


# --------------------------------------------------------------------------- experts served by a process of their own

def mlp(width: int, hidden: int | None = None, *, seed: int = 0) -> torch.nn.Sequential:
    """Linear(width, hidden) → ReLU → Linear(hidden, width) (``hidden`` = 4 × width by default),
    initialised from ``seed`` (the serving benchmark's expert)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hidden = 4 * width if hidden is None else hidden
        return torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, width))


BUILDERS: dict[str, Callable[..., torch.nn.Module]] = {
    "CharLM": CharLM, "VelocityMLP": VelocityMLP, "RouterMLP": RouterMLP, "mlp": mlp}
"""The modules an :func:`expert_process` can build: a name, then keyword arguments (JSON)."""


@dataclass
class ExpertSpec:
    """One expert for an :func:`expert_process` to serve: the module ``build(**kwargs)``
    (a name in :data:`BUILDERS`), with the weights ``state`` if given (a state_dict,
    sent as a file; else the builder's seeded initialisation), served as ``expert_id``."""

    expert_id: str
    build: str
    kwargs: dict
    kind: str = "module"
    domain: str | None = None
    state: dict | None = None
    max_batch: int = 32
    max_wait_ms: float = 5.0

    @classmethod
    def of(cls, module: torch.nn.Module, expert_id: str, **serve) -> ExpertSpec:
        """The spec of a kit model (:class:`CharLM`, :class:`VelocityMLP`, :class:`RouterMLP`)
        with its current weights; ``serve``: kind, domain, max_batch, max_wait_ms."""
        name = type(module).__name__
        if BUILDERS.get(name) is not type(module):
            raise ValueError(f"{name} is not one of the kit's models ({', '.join(BUILDERS)})")
        return cls(expert_id, name, dict(module.init_kwargs), state=module.state_dict(), **serve)


class ExpertProcess:
    """Experts served by a meshd node in a child process (:func:`expert_process`):
    its ``pid``, the node's ``address`` (``PEERID@HOST:PORT``) and ``peer_id``."""

    def __init__(self, process: subprocess.Popen, address: str, peer_id: str):
        self.process, self.address, self.peer_id = process, address, peer_id
        self.pid = process.pid

    def kill(self) -> None:
        """SIGKILL the process: its node stops without a word to its peers (no QUIC close)."""
        os.kill(self.pid, signal.SIGKILL)

    async def wait(self) -> int:
        """Wait for the process to end (reaping it); its return code (−9 after :meth:`kill`)."""
        return await trio.to_thread.run_sync(self.process.wait)


@asynccontextmanager
async def expert_process(path: Path, experts: list[ExpertSpec], *, bootstrap: str | None = None,
                         threads: int = 1, startup: float = 120.0) -> AsyncIterator[ExpertProcess]:
    """Serve ``experts`` from a meshd node in a child process (data directory ``path``,
    127.0.0.1, connected to ``bootstrap`` if given, ``threads`` torch threads), so that a
    test or benchmark can SIGKILL it (:meth:`ExpertProcess.kill`); yields once every expert
    is served (announced in the DHT).  On exit the child is told to stop (its stdin
    closes: the node closes as usual), and killed if it has not within 15 s.  Weights
    travel as a file of tensors loaded with ``weights_only=True``."""
    path.mkdir(parents=True, exist_ok=True)
    listed = []
    for i, spec in enumerate(experts):
        weights = None
        if spec.state is not None:
            weights = str(path / f"expert-{i}.pt")
            torch.save({k: v.detach().cpu().clone() for k, v in spec.state.items()}, weights)
        listed.append({"expert_id": spec.expert_id, "build": spec.build, "kwargs": spec.kwargs, "kind": spec.kind,
                       "domain": spec.domain, "weights": weights, "max_batch": spec.max_batch,
                       "max_wait_ms": spec.max_wait_ms})
    plan = path / "experts.json"
    plan.write_text(json.dumps({"data": str(path / "node"), "bootstrap": bootstrap, "threads": threads,
                                "experts": listed}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")])))
    process = subprocess.Popen([sys.executable, "-m", __name__, str(plan)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=env)
    try:
        with trio.fail_after(startup):
            line = await trio.to_thread.run_sync(process.stdout.readline, abandon_on_cancel=True)
        if not line:
            raise RuntimeError(f"the expert process exited ({process.wait()}) before serving {plan}")
        ready = json.loads(line)
        yield ExpertProcess(process, ready["address"], ready["peer_id"])
    finally:
        with trio.CancelScope(shield=True):
            if process.poll() is None:
                with contextlib.suppress(OSError):
                    process.stdin.close()
                try:
                    await trio.to_thread.run_sync(process.wait, 15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    await trio.to_thread.run_sync(process.wait)
            process.stdout.close()


_REPO = Path(__file__).resolve().parents[2]


async def _serve_plan(plan: dict) -> None:
    """The child's side of :func:`expert_process`: one node serving the plan's experts, its
    address on stdout (one JSON line), until stdin closes."""
    from ..daemon import open_node  # noqa: PLC0415  (the child only; the kit's models need no node)
    from ..services.experts import PROVIDER_PREFIX  # noqa: PLC0415

    bootstrap = plan["bootstrap"]
    async with open_node(Path(plan["data"]), listen="127.0.0.1:0", bootstrap=[bootstrap] if bootstrap else []) as node:
        if bootstrap:
            await node.connect(bootstrap)
        dht = node.service("dht").node if bootstrap else None
        for e in plan["experts"]:
            module = BUILDERS[e["build"]](**e["kwargs"])
            if e["weights"]:
                module.load_state_dict(torch.load(e["weights"], weights_only=True))
            await node.service("experts").serve(e["expert_id"], module.eval(), kind=e["kind"], domain=e["domain"],
                                                max_batch=e["max_batch"], max_wait_ms=e["max_wait_ms"])
            # a node that has just connected may not be in any DHT table yet: the DHT provides the
            # record again soon, but the parent is told "ready" only once a peer holds it
            pause = 0.02
            while dht is not None and not await dht.provide(PROVIDER_PREFIX + e["expert_id"].encode()):
                await trio.sleep(pause)
                pause = min(2 * pause, 0.5)
        print(json.dumps({"address": str(node.address), "peer_id": str(node.peer_id)}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)


if __name__ == "__main__":  # python -m meshd.testing.experts_kit PLAN.json (see expert_process)
    _plan = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(_plan["threads"])
    trio.run(_serve_plan, _plan)
