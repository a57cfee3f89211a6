"""Expert ensembles on the mesh: serving throughput, DDM sampling quality, faults, HDEE.

    .venv/bin/python benchmarks/experts.py [--quick] [--skip PARTS | --only PARTS] [--json FILE]

PARTS: serving, ddm, digits, faults, hdee-faults, hdee (``--only faults`` runs both fault parts), and
hdee-survey, run only when ``--only`` names it.

Every expert is served by its own meshd node (in this process, or where said
in a child process, ``experts_kit.expert_process``; real QUIC over 127.0.0.1,
the service's defaults); callers are another node.  One table per
part, each with its comparison from the same run:

* **serving**: one MLP expert (2048-8192-2048) served by a node in its own
  process under ``--callers`` concurrent callers (another node, this process,
  sharing one ``RemoteExpert``) sending one row per call for ``--seconds``,
  with batching on (max_batch 64, max_wait 2 ms), on with the callers' calls
  not coalesced (``RemoteExpert(coalesce=False)``: a request per call), and
  off (max_batch 1): rows/s and p50/p99
  call latency, beside the same module called in this process at batch 64
  and batch 1 (the ceiling), and beside hivemind's ``RemoteExpert`` serving the
  same module to the same callers (``benchmarks/hivemind_expert.py`` under
  ``/tmp/hm-venv``); then 4 such experts on 4 nodes, each request asking all
  4 at once (an ensemble's fan-out); then ``--rounds`` rounds of meshd
  (coalesced, and not) and hivemind back to back, each round's ratios beside.
* **ddm**: a 2-D mixture of 16 Gaussians on a 4x4 grid; k-means into K = 4
  clusters; one flow-matching expert per cluster on its own node and an MLP
  router r(k | x_t, t) on a fifth; samples by ``DDMEnsemble`` in modes full,
  top2, top1 and uniform, beside a monolith with the experts' total
  parameters trained for their total steps (in process, the same learning
  rate and decay), the floor (two held-out draws of the data) and references
  with no model error (``experts_kit.grid_velocity``: the exact velocity
  through the same sampler, and each mode with exact experts and router).
  Distance: ``experts_kit.grid_mmd``, the V-statistic MMD² of one RBF of
  fixed σ = 0.1 (never negative), and its square root, the MMD; mean and
  spread over ``--grid-seeds`` seeds (each its own data draws, k-means,
  models and noise); the expert rows and RPC calls each mode made.
  ``--json`` also writes seed 0's samples of every mode (``ddm_samples``,
  400 points each) for ``benchmarks/all.py``'s plot.
* **digits**: the same on scikit-learn's 8x8 digits (64-D, scaled to [-1, 1];
  1,197 images to train on, two held-out sets of 300), ``--ddm-steps`` steps
  at a constant rate, the same samples, the unbiased multi-bandwidth MMD²
  (``experts_kit.mmd``), one seed, experts of width 128 and a monolith of
  width 286 (the experts' total parameters); each set of samples (clamped to
  [-1, 1]) is labelled by a logistic regression fitted to the training images, and its coverage of
  the 10 classes reported: how many get at least half their fair share
  (``classes``), the labels' entropy in bits (3.32 when even) and the largest
  and smallest class's share (which digit, in brackets).
* **faults**: DDM sampling (top2) with expert c1 served by a process of its
  own, SIGKILLed (by pid) during the middle Euler step: the run completes,
  says in which steps c1 answered and from which it was dropped, how long the
  run and its slowest step took, and MMD² beside the same run with no fault;
  and (``hdee-faults``) HDEE decoding, byte by byte, of licence text over 3
  LM experts (one per domain, each on its own node), the licences expert's
  process SIGKILLed during the middle step: the same report with bits per
  byte, and the gap to the same mixture computed in process over the
  experts that answered each step.
* **hdee**: character-level LMs (a GRU over bytes) on three text domains
  (``--hdee-domains``: by default dpkg's file lists, Debian changelogs and
  maintainer scripts, the easiest, median and hardest of
  ``experts_kit.SURVEY_DOMAINS`` by ``hdee-survey``; Python source, licences
  and changelogs was the first setting) and man pages for evaluation only,
  as HDEE's paper: a seed model of each size (small, medium, large widths)
  on the mix; each domain's difficulty (the medium seed model's dev bits per
  byte) measured before any expert is trained; homogeneous experts (every one
  medium, the same steps) against heterogeneous ones (the easiest domain
  small, the hardest large, each expert's compute the arms' total shared in
  proportion to its domain's difficulty; ``--hdee-rule tiers``: the paper's
  fixed steps per size, the median as the homogeneous arm) at equal compute
  (parameters x steps x tokens), each
  branched from its size's seed model; bits per byte on each test text for
  each expert alone, the posterior ensemble (uniform and cached prior) and
  uniform averaging, over ``--hdee-seeds`` seeds (mean, spread, each seed);
  and the heterogeneous ensemble served on 3 nodes against the same mixture
  in process.
* **hdee-survey** (only with ``--only hdee-survey``): how hard each domain of
  ``experts_kit.SURVEY_DOMAINS`` is for a seed model trained on their mix,
  per seed, gzip's bits per byte beside, and the rule's pick for
  ``--hdee-domains``.

Targets (issue 13): batching >= 3x the unbatched rate; DDM full within 3x the
floor and >= 5x better than the monolith, every routed mode >= 10x better than
uniform (judged on MMD² in each seed: met, met in i of n seeds, or missed; the
ratios on MMD beside them), top-2 at most half the expert calls of full (rows
and RPC calls both shown); a heterogeneous HDEE ensemble best on 2 of 3
domains and on the held-out one, the mixture >= 0.1 bpc better than the best
expert there, the mesh within 1e-6 of in process.
The digits part prints the same ratios as the grid's DDM targets, without targets.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:1] = [str(REPO)]  # the repo, not this folder (benchmarks/nat.py shadows nat)

import torch  # noqa: E402
import trio  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import meshd  # noqa: E402
import meshd.experts as mx  # noqa: E402
from benchmarks.parts import log, run_anchor, run_parts, save_json, stop_on_sigterm  # noqa: E402


async def open_nodes(stack: AsyncExitStack, root: Path, count: int) -> list:
    """``count`` nodes on 127.0.0.1, bootstrapped from the first."""
    first = await stack.enter_async_context(meshd.open_node(root / "n0", listen="127.0.0.1:0"))
    nodes = [first]
    for i in range(1, count):
        node = await stack.enter_async_context(meshd.open_node(root / f"n{i}", listen="127.0.0.1:0",
                                                               bootstrap=[str(first.address)]))
        await node.connect(first.address)
        nodes.append(node)
    return nodes


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# --- serving ----------------------------------------------------------------------------------------


WIDTH = 2048  # the serving expert: WIDTH -> 4 WIDTH -> WIDTH, 33.6 M parameters (per-row compute above the RPC cost)


def mlp(seed: int) -> torch.nn.Module:
    from meshd.testing import experts_kit as kit

    return kit.mlp(WIDTH, seed=seed)


def in_process_rate(module, batch: int, seconds: float) -> float:
    """Rows per second through ``module`` at ``batch`` rows a call, in this thread."""
    x, rows, start = torch.randn(batch, WIDTH), 0, time.perf_counter()
    with torch.no_grad():
        while time.perf_counter() - start < seconds:
            module(x)
            rows += batch
    return rows / (time.perf_counter() - start)


async def load(experts: list, callers: int, seconds: float) -> tuple[float, list[float], list[int]]:
    """``callers`` tasks, each calling every one of ``experts`` at once with one row, again and again
    for ``seconds``: (requests per second, latencies, batch sizes seen)."""
    latencies, batches = [], []
    deadline = trio.current_time() + seconds

    async def caller(seed: int) -> None:
        x = torch.randn(1, WIDTH, generator=torch.Generator().manual_seed(seed))
        while trio.current_time() < deadline:
            started = trio.current_time()
            async with trio.open_nursery() as nursery:
                for expert in experts:
                    async def one(expert=expert):
                        batches.append((await expert.call(x)).batch)
                    nursery.start_soon(one)
            latencies.append(trio.current_time() - started)

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(callers):
            nursery.start_soon(caller, i)
    return len(latencies) / (trio.current_time() - started), latencies, batches


async def one_expert(args, root: Path, name: str, max_batch: int, coalesce: bool = True) -> dict:
    """The row of one expert served by a node in its own process (as hivemind's is) under
    ``args.callers`` callers on another node sharing one RemoteExpert, for ``args.seconds``."""
    from meshd.testing import experts_kit as kit

    server = kit.ExpertSpec("mlp", "mlp", {"width": WIDTH, "seed": 0}, max_batch=max_batch, max_wait_ms=2)
    async with kit.expert_process(root / "server", [server]) as process:
        async with meshd.open_node(root / "client", listen="127.0.0.1:0", bootstrap=[process.address]) as client:
            await client.connect(process.address)
            expert = mx.RemoteExpert(client, "mlp", coalesce=coalesce)
            await expert.call(torch.randn(1, WIDTH))  # lookup, connection and max_batch, unmeasured
            rate, lat, batches = await load([expert], args.callers, args.seconds)
    return {"part": "serving", "what": f"1 expert in its own process, {args.callers} callers, {name}",
            "rows/s": rate, "p50 ms": 1000 * pct(lat, 0.5), "p99 ms": 1000 * pct(lat, 0.99),
            "detail": f"mean batch {statistics.mean(batches):.1f} rows"}


def hivemind(args) -> dict:
    """The row of hivemind's RemoteExpert serving the same module to the same callers."""
    hm = run_anchor(args.hm_python, Path(__file__).parent / "hivemind_expert.py",
                    ["--width", str(WIDTH), "--callers", str(args.callers), "--seconds", str(args.seconds)], 300)
    if "error" in hm:
        return {"part": "serving", "what": "hivemind RemoteExpert", "detail": hm["error"][:150]}
    return {"part": "serving", "what": f"hivemind RemoteExpert, {args.callers} callers, max_batch 64",
            "rows/s": hm["rows_per_s"], "p50 ms": hm["p50_ms"], "p99 ms": hm["p99_ms"],
            "detail": f"hivemind 1.1.12, server and caller in 2 processes (+ p2pd), own netns; "
                      f"{hm['error_count']} errors"}


async def serving(args, root: Path) -> list[dict]:
    torch.set_num_threads(1)
    module, rows = mlp(0), []
    for batch in (64, 1):
        rate = in_process_rate(module, batch, args.seconds / 2)
        rows.append({"part": "serving", "what": f"in process, batch {batch} (ceiling)", "rows/s": rate})
    results = {}
    for name, max_batch, coalesce in (("batching on", 64, True), ("batching on, calls not coalesced", 64, False),
                                      ("batching off", 1, True)):
        rows.append(await one_expert(args, root / name.replace(" ", "-").replace(",", ""), name, max_batch, coalesce))
        results[name] = rows[-1]["rows/s"]
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, root / "ensemble", 5)
        for i, node in enumerate(nodes[:4]):
            await mx.serve(node, mlp(i), expert_id=f"e{i}", max_batch=64, max_wait_ms=2)
        experts = [mx.RemoteExpert(nodes[4], f"e{i}") for i in range(4)]
        for expert in experts:
            await expert.call(torch.randn(1, WIDTH))
        rate, lat, batches = await load(experts, args.callers, args.seconds)
    rows.append({"part": "serving", "what": f"4 experts on 4 nodes, {args.callers} callers asking all 4",
                 "rows/s": rate, "p50 ms": 1000 * pct(lat, 0.5), "p99 ms": 1000 * pct(lat, 0.99),
                 "detail": f"requests/s of the 4-way fan-out; mean batch {statistics.mean(batches):.1f}"})
    rows.append(hivemind(args))
    ratio = results["batching on"] / results["batching off"]
    versus = f"; batching on / hivemind {results['batching on'] / rows[-1]['rows/s']:.1f}x (target >= 2x)" \
        if "rows/s" in rows[-1] else ""
    rows.append({"part": "serving", "what": "targets", "rows/s": None,
                 "detail": f"batching on / off {ratio:.1f}x (target >= 3x){versus}"})
    for i in range(args.rounds):  # back to back, so that both see the same load of a shared machine
        coalesced = await one_expert(args, root / f"round-{i}", "batching on", 64)
        alone = await one_expert(args, root / f"round-{i}-alone", "batching on, calls not coalesced", 64, False)
        anchor = hivemind(args)
        for row in (coalesced, alone, anchor):
            row["what"] = f"round {i + 1}: {row['what']}"
        versus = f"; batching on / hivemind {coalesced['rows/s'] / anchor['rows/s']:.1f}x" if "rows/s" in anchor else ""
        rows += [coalesced, alone, anchor]
        rows.append({"part": "serving", "what": f"round {i + 1}: ratio", "rows/s": None,
                     "detail": f"coalesced / not {coalesced['rows/s'] / alone['rows/s']:.1f}x{versus}"})
    return rows


# --- DDM on the 4x4 grid, and an expert dying mid-sampling -------------------------------------------

MODES = (("full", "full", 2), ("top2", "topk", 2), ("top1", "top1", 1), ("uniform", "uniform", 2))
SAMPLES_KEPT = 400  # points of each mode's samples (seed 0) written to --json, for the plots
SAMPLES: dict[str, list] = {}  # what --json writes as "ddm_samples": name -> [[x, y], ...]


def ddm_models(args, monolith: bool = True, seed: int = 0) -> dict:
    """The grid's models for ``seed``: 4 experts, the router and (with ``monolith``) the monolith,
    trained with the grid's recipe (``--grid-steps``, ``--grid-lr``, ``--grid-decay``), measured by
    ``experts_kit.grid_mmd``."""
    from meshd.testing import experts_kit as kit

    torch.set_num_threads(1)
    started = time.perf_counter()
    models = kit.train_ddm(args.grid_steps, args.samples, monolith=monolith, seed=seed, lr=args.grid_lr,
                           decay=args.grid_decay, distance=kit.grid_mmd)
    models["train_s"] = time.perf_counter() - started
    log(f"[ddm] seed {seed}: trained 4 experts, the router{' and the monolith' if monolith else ''} in "
        f"{models['train_s']:.0f} s")
    return models


async def serve_ddm(stack: AsyncExitStack, root: Path, models: dict, elsewhere: tuple[int, ...] = ()) -> list:
    """K + 2 nodes: the K experts and the router each on its own, and a caller (the last);
    the experts numbered in ``elsewhere`` are left for the caller to serve (their nodes idle)."""
    count = len(models["experts"])
    nodes = await open_nodes(stack, root, count + 2)
    for k, expert in enumerate(models["experts"]):
        if k in elsewhere:
            continue
        await mx.serve(nodes[k], expert, expert_id=f"c{k}", kind="flow", domain=f"cluster {k}")
    await mx.serve(nodes[count], models["router"], expert_id="router", kind="router")
    return nodes


async def sample_modes(args, root: Path, models: dict, seed: int = 5) -> dict:
    """Every mode of :data:`MODES` over the mesh (each expert and the router on a node of its own):
    name -> (the ensemble's ``Sampled``, seconds)."""
    count, out = len(models["experts"]), {}
    async with AsyncExitStack() as stack:
        nodes = await serve_ddm(stack, root, models)
        for name, mode, k in MODES:
            ens = mx.DDMEnsemble(nodes[-1], [f"c{i}" for i in range(count)], "router" if mode != "uniform" else None,
                                 mode=mode, top_k=k)
            started = time.perf_counter()
            sampled = await ens.sample(args.samples, models["dim"], steps=args.ddm_sample_steps, seed=seed)
            out[name] = (sampled, time.perf_counter() - started)
    return out


async def ddm(args, root: Path, models: dict, part: str = "ddm") -> list[dict]:
    """Every mode over the mesh and the monolith in process, on ``models`` (``experts_kit.train_ddm_on``'s,
    plus ``judge``, a function from samples to more columns, if the data has one); one run (the digits)."""
    from meshd.testing import experts_kit as kit

    torch.set_num_threads(1)
    rows, floor, dim, count = [], models["floor"], models["dim"], len(models["experts"])
    judge, distance = models.get("judge", lambda x: {}), models.get("distance", kit.mmd)
    with torch.no_grad():
        mono_x = kit.sample_flow(models["monolith"], args.samples, dim, args.ddm_sample_steps, seed=5)
    mono = distance(mono_x, models["held"])
    rows.append({"part": part, "what": "floor: held-out vs held-out", "mmd2": floor, **judge(models["held2"])})
    rows.append({"part": part, "what": f"monolith ({models['params'][1]:,} params, {count * models['steps']} steps)",
                 "mmd2": mono, **judge(mono_x)})
    scores, evals = {}, {}
    for name, (out, seconds) in (await sample_modes(args, root / part, models)).items():
        scores[name], evals[name] = distance(out.x, models["held"]), sum(out.rows.values())
        rows.append({"part": part, "what": f"DDM {name} over the mesh ({count} x {models['params'][0]:,} params)",
                     "mmd2": scores[name], "evals": evals[name], **judge(out.x),
                     "detail": f"{seconds:.1f} s; calls {sum(out.calls.values())}"
                               + (f"; DROPPED {out.dropped}" if out.dropped else "")})
    versus_floor = (f"full {scores['full'] / floor:.1f}x the floor" if floor > 0 else
                    f"full {scores['full']:.4f} above a floor of {floor:.4f} (at the estimator's noise)")
    checks = [versus_floor, f"monolith / full {mono / scores['full']:.1f}x",
              *(f"uniform / {m} {scores['uniform'] / scores[m]:.1f}x" for m in ("full", "top2", "top1")),
              f"top2 evals / full {evals['top2'] / evals['full']:.2f}"]
    rows.append({"part": part, "what": "ratios", "detail": "; ".join(checks)})
    return rows


def _spread(values: list[float], digits: int = 5) -> str:
    """'mean ± sd (min-max)' of one value per seed."""
    if len(values) < 2:
        return f"{values[0]:.{digits}f} (one seed)"
    return (f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})")


def _ratio(values: list[float]) -> str:
    """'mean (min-max)x' of one ratio per seed."""
    return f"{statistics.mean(values):.2f}x ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 \
        else f"{values[0]:.2f}x"


def _keep(x: torch.Tensor) -> list:
    return [[round(float(a), 4), round(float(b), 4)] for a, b in x[:SAMPLES_KEPT].tolist()]


def exact_samples(args, models: dict, seed: int = 5) -> dict[str, torch.Tensor]:
    """References with no model error, in process: the grid's exact velocity through the same Euler
    sampler, and the DDM modes with exact experts (each its cluster's exact velocity) and the exact
    router (``experts_kit.grid_velocity``, ``grid_cluster_logits``): what the sampler costs, and what
    hard routing costs by itself."""
    from experts import ddm as math_
    from meshd.testing import experts_kit as kit

    k, n, steps = len(models["experts"]), args.samples, args.ddm_sample_steps
    experts = [lambda x, t, c=c: kit.grid_velocity(x, t, modes=models["mode_clusters"] == c) for c in range(k)]

    def ensemble(mode: str, top: int):
        def velocity(x, t):
            logits = kit.grid_cluster_logits(x, t, models["mode_clusters"], k)
            return math_.combine(math_.route(logits, mode, top), {c: f(x, t) for c, f in enumerate(experts)})[0]
        return velocity

    out = {"exact velocity": kit.sample_flow(kit.grid_velocity, n, 2, steps, seed=seed)}
    for name, mode, top in MODES[:3]:
        out[f"exact experts and router, {name}"] = kit.sample_flow(ensemble(mode, top), n, 2, steps, seed=seed)
    return out


async def ddm_grid(args, root: Path, first: dict) -> list[dict]:
    """The grid over ``--grid-seeds`` seeds (``first``: seed 0's models, kept for the faults part),
    each seed its own data draws, k-means, models and sampling noise: the floor, the monolith, every
    mode over the mesh and the exact references, by ``experts_kit.grid_mmd``; mean and spread over
    the seeds, and issue 13's targets."""
    from meshd.testing import experts_kit as kit

    torch.set_num_threads(1)
    per: dict[str, dict[str, list]] = {}  # row -> {"d": [MMD² per seed], "evals": [...], "calls": [...], "s": [...]}
    params, count, train_s = first["params"], len(first["experts"]), []

    def add(name: str, value: float, **more) -> None:
        row = per.setdefault(name, {"d": []})
        row["d"].append(value)
        for key, v in more.items():
            row.setdefault(key, []).append(v)

    for seed in range(args.grid_seeds):
        models = first if seed == 0 else ddm_models(args, seed=seed)
        train_s.append(models["train_s"])
        held, distance = models["held"], models["distance"]
        add("floor", models["floor"])
        with torch.no_grad():
            mono_x = kit.sample_flow(models["monolith"], args.samples, 2, args.ddm_sample_steps, seed=5 + seed)
        add("monolith", distance(mono_x, held))
        sampled = await sample_modes(args, root / f"ddm{seed}", models, seed=5 + seed)
        for name, (out, seconds) in sampled.items():
            add(name, distance(out.x, held), evals=sum(out.rows.values()), calls=sum(out.calls.values()), s=seconds,
                dropped=len(out.dropped))
        for name, x in exact_samples(args, models, seed=5 + seed).items():
            add(name, distance(x, held))
        log(f"[ddm] seed {seed}: " + ", ".join(f"{name} {row['d'][-1]:.5f}" for name, row in per.items()))
        if seed == 0:
            SAMPLES.update({"held-out data": _keep(held), "monolith": _keep(mono_x),
                            **{name: _keep(out.x) for name, (out, _) in sampled.items()}})
    mean = {name: statistics.mean(row["d"]) for name, row in per.items()}
    seeds = f"{args.grid_seeds} seed{'s' if args.grid_seeds > 1 else ''}"
    labels = {"floor": "floor: held-out vs held-out",
              "monolith": f"monolith ({params[1]:,} params, {count * args.grid_steps} steps), in process",
              **{name: f"DDM {name} over the mesh ({count} x {params[0]:,} params, {args.grid_steps} steps each)"
                 for name, _, _ in MODES},
              "exact velocity": "reference: the exact velocity, same sampler, in process",
              **{f"exact experts and router, {name}": f"reference: DDM {name}, exact experts and router, in process"
                 for name, _, _ in MODES[:3]}}
    rows = []
    for name, row in per.items():
        detail = [f"MMD² {_spread(row['d'])} over {seeds}",
                  f"MMD {_spread([math.sqrt(v) for v in row['d']], 4)}"]
        if name != "floor":
            detail.append(f"{mean[name] / mean['floor']:.1f}x the floor's MMD²")
        if "s" in row:
            detail.append(f"{statistics.mean(row['s']):.1f} s a run, calls {row['calls'][0]}"
                          + (f", DROPPED in {sum(row['dropped'])} runs" if sum(row["dropped"]) else ""))
        rows.append({"part": "ddm", "what": labels[name], "mmd2": mean[name], "mmd": statistics.mean(
            math.sqrt(v) for v in row["d"]), "evals": row["evals"][0] if "evals" in row else None,
            "calls": row["calls"][0] if "calls" in row else None, "detail": "; ".join(detail)})

    def ratios(a: str, b: str, root_: bool = False) -> list[float]:
        f = math.sqrt if root_ else (lambda v: v)
        return [f(x) / f(y) for x, y in zip(per[a]["d"], per[b]["d"])]

    def verdict(values: list[float], ok) -> str:
        hits = sum(map(ok, values))
        return "met" if hits == len(values) else "MISSED" if not hits else f"met in {hits} of {len(values)} seeds"

    calls = [c / f for c, f in zip(per["top2"]["calls"], per["full"]["calls"])]
    evals = [c / f for c, f in zip(per["top2"]["evals"], per["full"]["evals"])]
    checks = [("full / floor", ratios("full", "floor"), ratios("full", "floor", True), lambda r: r <= 3, "<= 3x"),
              ("monolith / full", ratios("monolith", "full"), ratios("monolith", "full", True), lambda r: r >= 5,
               ">= 5x"),
              *((f"uniform / {m}", ratios("uniform", m), ratios("uniform", m, True), lambda r: r >= 10, ">= 10x")
                for m in ("full", "top2", "top1"))]
    text = [f"{what} {_ratio(sq)} on MMD² ({_ratio(rt)} on MMD): {verdict(sq, ok)} (target {goal})"
            for what, sq, rt, ok, goal in checks]
    text.append(f"top2 / full: expert rows {_ratio(evals)}: {verdict(evals, lambda r: r <= 0.5)}, "
                f"RPC calls {_ratio(calls)}: {verdict(calls, lambda r: r <= 0.5)} (target <= 0.5)")
    rows.append({"part": "ddm", "what": f"targets, mean (min-max) over {seeds}", "detail": "; ".join(text)})
    rows.append({"part": "ddm", "what": "training", "detail":
                 f"{_spread(train_s, 0)} s a seed for 4 experts, the router and the monolith; lr {args.grid_lr}, "
                 f"decayed linearly to 0 over the last {args.grid_decay:.0%} of the steps; distance: "
                 f"experts_kit.grid_mmd (V-statistic MMD², one RBF, σ = {kit.GRID_MMD_SIGMA}), {args.samples} "
                 f"samples against {args.samples} held-out points, {args.ddm_sample_steps} Euler steps"})
    return rows


# --- DDM on scikit-learn's digits ----------------------------------------------------------------------

DIGITS_WIDTH, DIGITS_MONOLITH_WIDTH = 128, 286  # 51,648 parameters an expert; 205,698 ~ 4 x 51,648


def digits_models(args) -> dict:
    """``ddm_models`` on the digits, with a classifier (logistic regression on the training images)
    to judge samples by the classes they are labelled as."""
    from meshd.testing import digits as dg
    from meshd.testing import experts_kit as kit

    torch.set_num_threads(1)  # as ddm() samples: the same numbers whichever parts ran before
    started = time.perf_counter()
    data = dg.digits_data()
    models = kit.train_ddm_on(data["train"], data["held"], data["held2"], args.ddm_steps, width=DIGITS_WIDTH,
                              monolith_width=DIGITS_MONOLITH_WIDTH)
    classify = dg.digit_classifier(data["train"], data["train_y"])
    log(f"[digits] trained 4 experts, the router, the monolith and the classifier in "
        f"{time.perf_counter() - started:.0f} s")

    def judge(x: torch.Tensor) -> dict:
        c = dg.coverage(classify(x.clamp(-1, 1)))
        most, least = (c["counts"].index(f(c["counts"])) for f in (max, min))
        return {"classes": c["covered"], "H bits": c["entropy"],
                "shares max/min": f"{c['max_share']:.3f} ({most}) / {c['min_share']:.3f} ({least})"}

    held, labels = torch.cat([data["held"], data["held2"]]), torch.cat([data["held_y"], data["held2_y"]])
    models.update(judge=judge, accuracy=float((classify(held) == labels).float().mean()),
                  clusters=[torch.bincount(data["train_y"][models["assign"] == k], minlength=10).tolist()
                            for k in range(len(models["experts"]))])
    return models


async def digits(args, root: Path, models: dict) -> list[dict]:
    def top(counts: list[int]) -> str:
        ranked = sorted(range(10), key=lambda d: -counts[d])[:3]
        return f"{sum(counts)} images, mostly " + ", ".join(f"{d} ({counts[d]})" for d in ranked)

    rows = [{"part": "digits", "what": "classifier: logistic regression, held-out accuracy",
             "detail": f"{models['accuracy']:.3f} on {len(models['held']) + len(models['held2'])} held-out images"},
            {"part": "digits", "what": "k-means clusters of the training images",
             "detail": "; ".join(f"c{k}: {top(counts)}" for k, counts in enumerate(models["clusters"]))}]
    return rows + await ddm(args, root, models, part="digits")


async def steps_with_kill(steps: int, step, victim=None, kill_at: int | None = None) -> tuple[list, list, int | None]:
    """``await step(i)`` for i in range(steps), the results and each one's seconds.  With
    ``victim`` (an ``experts_kit.ExpertProcess``), another task SIGKILLs it by pid as soon as
    step ``kill_at`` has begun (while that step's calls are in flight) and reaps it; the third
    value is the first step that began after it was gone."""
    reached, gone, results, seconds, first_after = trio.Event(), trio.Event(), [], [], None

    async def kill() -> None:
        await reached.wait()
        victim.kill()
        await victim.wait()
        gone.set()

    async with trio.open_nursery() as nursery:
        if victim is not None:
            nursery.start_soon(kill)
        for i in range(steps):
            if i == kill_at:
                reached.set()
            if first_after is None and gone.is_set():
                first_after = i
            started = time.perf_counter()
            results.append(await step(i))
            seconds.append(time.perf_counter() - started)
        if not reached.is_set():  # kill_at past the last step: nothing to wait for
            nursery.cancel_scope.cancel()
    return results, seconds, first_after


def spans(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, run = [], []
    for i in sorted(indices):
        if run and i != run[-1] + 1:
            out.append(run)
            run = []
        run.append(i)
    out += [run] if run else []
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in out) or "none"


def timing(seconds: list[float]) -> str:
    """The run's seconds, a step's median, and the steps that took over 0.5 s (a straggler wait is 1 s)."""
    slow = ", ".join(f"{i} ({s:.2f} s)" for i, s in enumerate(seconds) if s > 0.5) or "none"
    return f"{sum(seconds):.1f} s ({statistics.median(seconds) * 1000:.0f} ms a step median; steps over 0.5 s: {slow})"


async def faults(args, root: Path, models: dict) -> list[dict]:
    """top2 sampling with expert c1 served by a process of its own, once as is and once with
    that process SIGKILLed (by pid) during step steps/2: the run completes, which steps c1
    answered, how long it took, and MMD² with and without the fault."""
    from experts import ddm as math_
    from meshd.testing import experts_kit as kit

    torch.set_num_threads(1)
    steps, kill_at, victim_id = args.ddm_sample_steps, args.ddm_sample_steps // 2, "c1"
    times, names, rows = math_.euler_times(steps), [f"c{i}" for i in range(len(models["experts"]))], []
    async with AsyncExitStack() as stack:
        nodes = await serve_ddm(stack, root / "faults", models, elsewhere=(1,))
        spec = kit.ExpertSpec.of(models["experts"][1], victim_id, kind="flow", domain="cluster 1")
        victim = await stack.enter_async_context(
            kit.expert_process(root / "faults" / "victim", [spec], bootstrap=str(nodes[0].address)))
        scores = {}
        for fault in (False, True):
            ens = mx.DDMEnsemble(nodes[-1], names, "router", mode="topk", top_k=2)
            for expert in (*ens.experts, ens.router):  # each found and connected before the clock starts
                await expert.call(torch.zeros(1, models["dim"]), torch.zeros(1))
            x = torch.randn(args.samples, models["dim"], generator=torch.Generator().manual_seed(5))

            async def step(i: int) -> mx.Sampled:
                nonlocal x
                sampled = mx.Sampled(torch.zeros(0), {}, {})
                x = math_.euler_step(x, await ens.velocity(x, times[i], sampled), 1 / steps)
                return sampled

            per_step, seconds, first_after = await steps_with_kill(steps, step, victim if fault else None, kill_at)
            scores[fault] = models["distance"](x, models["held"])
            evals = sum(sum(s.rows.values()) for s in per_step)
            answered = [i for i, s in enumerate(per_step) if victim_id in s.rows]
            dropped = [i for i, s in enumerate(per_step) if victim_id in s.dropped]
            why = next((s.dropped[victim_id] for s in per_step if victim_id in s.dropped), "")
            if not fault:
                rows.append({"part": "faults", "what": f"DDM top2, {victim_id} in its own process, no fault",
                             "mmd2": scores[fault], "evals": evals,
                             "detail": f"completed in {timing(seconds)}; {victim_id} evaluated rows in steps "
                                       f"{spans(answered)}; dropped in steps {spans(dropped)}"})
                continue
            after = range(first_after if first_after is not None else steps, steps)
            rows.append({"part": "faults", "what": f"DDM top2, {victim_id}'s process SIGKILLed during step {kill_at} "
                                                   f"of {steps}", "mmd2": scores[fault], "evals": evals,
                         "detail": f"completed in {timing(seconds)}; {victim_id} evaluated rows in steps "
                                   f"{spans(answered)}, dropped in steps {spans(dropped)} (after the kill: "
                                   f"{sum(victim_id not in per_step[i].rows for i in after)} of {len(after)} steps "
                                   f"without it); MMD² {scores[True] / scores[False]:.1f}x the no-fault run's; "
                                   f"why: {why[:90]}"})
    return rows


def hdee_fault_models(args) -> dict:
    """Three char LMs, one per trained domain, each ``--fault-lm-steps`` steps from scratch."""
    from meshd.testing import experts_kit as kit

    torch.set_num_threads(1)
    started = time.perf_counter()
    data = {d: kit.splits(d, args.hdee_chars) for d in kit.DOMAINS}
    experts = {}
    for i, d in enumerate(kit.DOMAINS):
        experts[d] = kit.CharLM(width=args.hdee_width, seed=i)
        kit.train_lm(experts[d], data[d]["train"], args.fault_lm_steps, seed=i)
        experts[d].eval()
    log(f"[hdee-faults] trained 3 LM experts in {time.perf_counter() - started:.0f} s")
    return {"data": data, "experts": experts}


async def hdee_faults(args, root: Path) -> list[dict]:
    """HDEE decoding, byte by byte (each step asks every expert for the next byte's distribution
    given the text so far), of ``--fault-tokens`` bytes of licence text over 3 LM experts, each
    on its own node; the licences expert's node is a process of its own, SIGKILLed (by pid)
    during the middle step of the second run: the run completes, which steps the expert answered,
    how long it took, and bits per byte with and without the fault, beside the same mixture
    computed in process over the experts that answered each step."""
    from experts import hdee as mixing
    from meshd.testing import experts_kit as kit

    m = hdee_fault_models(args)
    domains, victim_domain = list(kit.DOMAINS), "licenses"
    ids = {d: f"lm-{d}" for d in domains}
    victim_id, tokens = ids[victim_domain], args.fault_tokens
    text = m["data"][victim_domain]["test"][:tokens + 2]
    kill_at = tokens // 2
    local = {ids[d]: kit.token_logprobs(m["experts"][d], text).double() for d in domains}  # [tokens + 1]
    rows = []
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, root / "hdee-faults", len(domains))  # the caller, and one per other expert
        for node, d in zip(nodes[1:], [d for d in domains if d != victim_domain]):
            await mx.serve(node, m["experts"][d], expert_id=ids[d], kind="lm", domain=d)
        spec = kit.ExpertSpec.of(m["experts"][victim_domain], victim_id, kind="lm", domain=victim_domain)
        victim = await stack.enter_async_context(
            kit.expert_process(root / "hdee-faults" / "victim", [spec], bootstrap=str(nodes[0].address)))
        bits = {}
        for fault in (False, True):
            ens = mx.HDEEEnsemble(nodes[0], list(ids.values()))
            for expert in ens.experts.values():  # each found and connected before the clock starts
                await expert.call(text[None, :2])

            async def step(i: int) -> tuple[float, list[str]]:  # predict text[i + 2] from text[:i + 2]
                logp, scored = await ens.next_token_logprobs(text[:i + 2])
                return float(logp[text[i + 2]]), scored.answered

            per_step, seconds, first_after = await steps_with_kill(tokens, step, victim if fault else None, kill_at)
            logp = torch.tensor([lp for lp, _ in per_step], dtype=torch.float64)
            reference = torch.stack([mixing.posterior_mixture(torch.stack([local[e] for e in answered]))[0][i + 1]
                                     for i, (_, answered) in enumerate(per_step)])
            gap = float((logp - reference).abs().max())
            bits[fault] = (kit.bpc(logp), kit.bpc(logp[kill_at:]))
            answered = [i for i, (_, who) in enumerate(per_step) if victim_id in who]
            label = (f"HDEE decoding {tokens} bytes of licence text, 3 experts, {victim_id} in its own process" +
                     (f", SIGKILLed during step {kill_at}" if fault else ", no fault"))
            detail = (f"completed in {timing(seconds)}; {victim_id} answered steps {spans(answered)}; "
                      f"bpc from step {kill_at} on {bits[fault][1]:.3f}; max |Δ log p| against the same mixture "
                      f"in process over the experts that answered each step {gap:.1e}")
            if fault:
                after = range(first_after if first_after is not None else tokens, tokens)
                detail += (f"; after the kill {sum(victim_id not in per_step[i][1] for i in after)} of {len(after)} "
                           f"steps without it; bpc from step {kill_at} on: +{bits[True][1] - bits[False][1]:.3f} "
                           f"against no fault")
            rows.append({"part": "hdee-faults", "what": label, "bpc": bits[fault][0], "detail": detail})
    rows.append({"part": "hdee-faults", "what": "HDEE: each expert alone on the same text (in process)",
                 "detail": "; ".join(f"{e} {kit.bpc(lp[1:]):.3f}" for e, lp in local.items())})
    return rows


# --- HDEE: character-level LM experts per text domain --------------------------------------------------

HDEE_DOMAINS = "filelists,changelogs,scripts"  # --only hdee-survey's pick (the easiest, median and hardest)


def hdee_sizes(args) -> dict[str, int]:
    """The GRU width of each size: ``--hdee-widths`` small and large, ``--hdee-width`` the medium."""
    small, large = (int(w) for w in args.hdee_widths.split(","))
    return {"small": small, "medium": args.hdee_width, "large": large}


def hdee_plans(args, hardness: dict[str, float]) -> dict[str, dict[str, tuple[str, int]]]:
    """Each arm's (size, steps) per domain, at equal compute (parameters x steps x tokens per step).

    Homogeneous: every expert medium, ``--hdee-steps`` steps.  Heterogeneous, as HDEE's paper
    (sizes s/m/l, 300/400/500 steps by the domain's difficulty): the domains ranked by ``hardness``
    (measured before any expert is trained), the easiest third small and ``--hdee-short`` of the
    steps, the hardest third large and the steps that make the two arms' totals equal, the rest
    medium with the homogeneous steps (the same expert as the homogeneous arm's).  With
    ``--hdee-rule proportional`` the sizes are the same, but each expert's compute is the arms'
    total shared in proportion to its domain's hardness, so no domain's expert is the same in both
    arms."""
    from meshd.testing import experts_kit as kit

    params = {size: kit.param_count(kit.CharLM(width=w)) for size, w in hdee_sizes(args).items()}
    ranked = sorted(hardness, key=hardness.get)
    third = len(ranked) // 3
    size = {d: "small" if i < third else "large" if i >= len(ranked) - third else "medium"
            for i, d in enumerate(ranked)}
    steps, short = args.hdee_steps, round(args.hdee_short * args.hdee_steps)
    if args.hdee_rule == "proportional":  # each expert's compute in proportion to its domain's hardness
        total = len(hardness) * params["medium"] * steps
        planned = {d: round(total * h / sum(hardness.values()) / params[size[d]]) for d, h in hardness.items()}
    else:  # small x short + large x long = 2 x medium x steps, for each small/large pair
        long = round((2 * params["medium"] * steps - params["small"] * short) / params["large"])
        planned = {d: {"small": short, "medium": steps, "large": long}[size[d]] for d in hardness}
    return {"homogeneous": {d: ("medium", steps) for d in hardness},
            "heterogeneous": {d: (size[d], planned[d]) for d in hardness}}


def hdee_compute(args, plan: dict[str, tuple[str, int]]) -> int:
    """Parameters x steps x tokens per step (batch 32 x 128 bytes) summed over a plan's experts."""
    from meshd.testing import experts_kit as kit

    widths = hdee_sizes(args)
    return sum(kit.param_count(kit.CharLM(width=widths[s])) * n * 32 * 128 for s, n in plan.values())


def hdee_models(args, seed: int) -> dict:
    """HDEE's recipe at toy scale, all in this process: a seed model of each size on the mix of the
    trained domains (the same steps and batches), the domains' difficulty (the medium seed model's
    bits per byte on ``--hdee-dev`` bytes of each domain's dev text), then each arm's experts
    branched from the seed model of their size and trained on their domain (:func:`hdee_plans`);
    an expert both arms plan alike is trained once (as the paper's medium expert)."""
    from meshd.testing import experts_kit as kit

    torch.manual_seed(seed)
    domains = args.hdee_domains.split(",")
    data = {d: kit.splits(d, args.hdee_chars) for d in (*domains, kit.EVAL_DOMAIN)}
    mix = torch.cat([data[d]["train"] for d in domains])
    seeds = {}
    for size, width in hdee_sizes(args).items():
        seeds[size] = kit.CharLM(width=width, seed=seed)
        kit.train_lm(seeds[size], mix, args.hdee_seed_steps, seed=seed)
    hardness = {d: kit.bpc(kit.token_logprobs(seeds["medium"], data[d]["dev"][:args.hdee_dev])) for d in domains}
    plans = hdee_plans(args, hardness)
    trained, experts = {}, {}
    for plan, configs in plans.items():
        for i, d in enumerate(domains):
            key = (d, *configs[d])
            if key not in trained:
                expert = kit.branch(seeds[configs[d][0]])
                kit.train_lm(expert, data[d]["train"], configs[d][1], seed=seed * 10 + i)
                trained[key] = expert.eval()
            experts[plan, d] = trained[key]
    return {"domains": domains, "data": data, "experts": experts, "plans": plans, "hardness": hardness}


def hdee_survey(args, root: Path) -> list[dict]:
    """How hard each candidate domain is, before any expert is trained: a seed model (medium width,
    ``--hdee-seed-steps`` on the mix of every domain in ``experts_kit.SURVEY_DOMAINS``), its bits per
    byte on each domain's dev text (``--hdee-dev`` bytes), per seed; gzip -9's bits per byte
    beside (no model).  The rule ``--hdee-domains`` was chosen by: the easiest, the median and the
    hardest by the mean over seeds."""
    import gzip

    from meshd.testing import experts_kit as kit

    torch.set_num_threads(1)
    data = {d: kit.splits(d, args.hdee_chars) for d in kit.SURVEY_DOMAINS}
    mix = torch.cat([data[d]["train"] for d in kit.SURVEY_DOMAINS])
    bpc: dict[str, list[float]] = {d: [] for d in kit.SURVEY_DOMAINS}
    for seed in range(args.hdee_seeds):
        model = kit.CharLM(width=args.hdee_width, seed=seed)
        kit.train_lm(model, mix, args.hdee_seed_steps, seed=seed)
        for d in kit.SURVEY_DOMAINS:
            bpc[d].append(kit.bpc(kit.token_logprobs(model, data[d]["dev"][:args.hdee_dev])))
    ranked = sorted(kit.SURVEY_DOMAINS, key=lambda d: statistics.mean(bpc[d]))
    rows = []
    for rank, d in enumerate(ranked):
        text = kit.domain_text(d, args.hdee_chars).encode()
        rows.append({"part": "hdee-survey", "what": f"{rank + 1}. {d}", "bpc": statistics.mean(bpc[d]),
                     "detail": f"seeds {', '.join(f'{v:.3f}' for v in bpc[d])}; gzip -9 "
                               f"{8 * len(gzip.compress(text, 9)) / len(text):.3f} bits per byte"})
    pick = [ranked[0], ranked[len(ranked) // 2], ranked[-1]]
    rows.append({"part": "hdee-survey", "what": "the rule's pick (easiest, median, hardest)",
                 "detail": f"--hdee-domains {','.join(pick)} (in use: {args.hdee_domains})"})
    return rows


def _pm(values: list[float]) -> str:
    """'mean ± half the range' of one value per seed, and the seeds'."""
    half = (max(values) - min(values)) / 2
    return f"{statistics.mean(values):.3f} ± {half:.3f} (seeds {', '.join(f'{v:.3f}' for v in values)})"


async def hdee(args, root: Path) -> list[dict]:
    from experts import hdee as mixing
    from meshd.testing import experts_kit as kit

    torch.set_num_threads(1)
    domains = args.hdee_domains.split(",")
    evals = [*domains, kit.EVAL_DOMAIN]
    table: dict = {}  # (what, domain) -> [bpc per seed]
    configs, worst_gap = [], 0.0
    for seed in range(args.hdee_first_seed, args.hdee_first_seed + args.hdee_seeds):
        started = time.perf_counter()
        m = hdee_models(args, seed)
        configs.append(m)
        log(f"[hdee] seed {seed}: trained in {time.perf_counter() - started:.0f} s, difficulty "
            f"{ {d: round(h, 3) for d, h in m['hardness'].items()} }, plans {m['plans']}")
        tests = {d: m["data"][d]["test"][:args.hdee_eval] for d in evals}
        logp = {(plan, e, d): kit.token_logprobs(m["experts"][plan, e], tests[d]).double()
                for plan in m["plans"] for e in domains for d in evals}
        for plan in m["plans"]:
            # the cached prior: the mean final posterior over dev text of every trained domain
            finals = []
            for d in domains:
                dev = m["data"][d]["dev"][:args.hdee_eval]
                lp = torch.stack([kit.token_logprobs(m["experts"][plan, e], dev).double() for e in domains])
                _, log_w = mixing.posterior_mixture(lp)
                finals.append(torch.log_softmax(log_w[:, -1] + lp[:, -1], 0))
            prior = mixing.estimate_prior(torch.stack(finals))
            for d in evals:
                lp = torch.stack([logp[plan, e, d] for e in domains])
                for e in domains:
                    table.setdefault((f"{plan}: expert {e} alone", d), []).append(kit.bpc(logp[plan, e, d]))
                table.setdefault((f"{plan}: posterior, uniform prior", d), []).append(
                    kit.bpc(mixing.posterior_mixture(lp)[0]))
                table.setdefault((f"{plan}: posterior, cached prior", d), []).append(
                    kit.bpc(mixing.posterior_mixture(lp, prior)[0]))
                table.setdefault((f"{plan}: uniform averaging", d), []).append(kit.bpc(mixing.uniform_mixture(lp)))
        async with AsyncExitStack() as stack:  # the heterogeneous ensemble, each expert on its own node
            nodes = await open_nodes(stack, root / f"hdee{seed}", len(domains) + 1)
            for node, d in zip(nodes, domains):
                await mx.serve(node, m["experts"]["heterogeneous", d], expert_id=f"{d}-{seed}", kind="lm", domain=d)
            ens = mx.HDEEEnsemble(nodes[-1], [f"{d}-{seed}" for d in domains])
            for d in evals:
                scored = await ens.score(tests[d])
                local = mixing.posterior_mixture(torch.stack([logp["heterogeneous", e, d] for e in domains]))[0]
                worst_gap = max(worst_gap, float((scored.logp.double() - local).abs().max()))
    widths = hdee_sizes(args)
    rows = []
    for seed, m in enumerate(configs, start=args.hdee_first_seed):
        for plan, plan_configs in m["plans"].items():
            rows.append({"part": "hdee", "what": f"seed {seed}: {plan} experts", "detail": "; ".join(
                f"{d} (dev bpc of the seed model {m['hardness'][d]:.3f}): {size}, width {widths[size]}, "
                f"{kit.param_count(m['experts'][plan, d]):,} parameters, {steps} steps"
                for d, (size, steps) in plan_configs.items())
                + f"; compute {hdee_compute(args, plan_configs):.4g} parameter-tokens"})
    for (what, d), values in sorted(table.items(), key=lambda kv: (evals.index(kv[0][1]), kv[0][0])):
        rows.append({"part": "hdee", "what": f"{d}: {what}", "bpc": statistics.mean(values),
                     "detail": f"seeds {', '.join(f'{v:.3f}' for v in values)}"})
    ensembles = ("posterior, uniform prior", "posterior, cached prior", "uniform averaging")

    def mean(plan: str, what: str, d: str) -> float:
        return statistics.mean(table[(f"{plan}: {what}", d)])

    def best_ensemble(d: str) -> tuple[str, str]:
        return min(((plan, rule) for plan in ("homogeneous", "heterogeneous") for rule in ensembles),
                   key=lambda pr: mean(*pr, d))

    for d in evals:  # the arms side by side: the posterior (uniform prior), mean ± half the range over seeds
        homog = table[("homogeneous: posterior, uniform prior", d)]
        hetero = table[("heterogeneous: posterior, uniform prior", d)]
        diff = [b - a for a, b in zip(homog, hetero)]
        rows.append({"part": "hdee", "what": f"{d}: heterogeneous - homogeneous, posterior (uniform prior)",
                     "bpc": statistics.mean(diff),
                     "detail": f"homogeneous {_pm(homog)}; heterogeneous {_pm(hetero)}; "
                               f"heterogeneous better in {sum(x < 0 for x in diff)} of {len(diff)} seeds"})
    per_seed = [statistics.mean(table[(f"{plan}: posterior, uniform prior", d)][s] for d in domains)
                for plan in ("homogeneous", "heterogeneous") for s in range(args.hdee_seeds)]
    n = args.hdee_seeds
    rows.append({"part": "hdee", "what": "the trained domains' mean, posterior (uniform prior)",
                 "bpc": statistics.mean(per_seed[n:]) - statistics.mean(per_seed[:n]),
                 "detail": f"homogeneous {_pm(per_seed[:n])}; heterogeneous {_pm(per_seed[n:])}"})
    hetero_best = [d for d in evals if best_ensemble(d)[0] == "heterogeneous"]
    held_out = kit.EVAL_DOMAIN
    single = min(mean(plan, f"expert {e} alone", held_out) for plan in ("homogeneous", "heterogeneous") for e in domains)
    rule = best_ensemble(held_out)
    rows.append({"part": "hdee", "what": "targets", "detail":
                 f"the best ensemble is heterogeneous on {', '.join(hetero_best) or 'none'} (target: 2 of 3 trained "
                 f"domains and {held_out}); on {held_out} the best ensemble ({rule[0]}, {rule[1]}) beats the best "
                 f"single expert by {single - mean(*rule, held_out):.3f} bpc (target >= 0.1); over the mesh vs in "
                 f"process: max |Δ log p| {worst_gap:.1e} (target <= 1e-6)"})
    return rows


# --- the table --------------------------------------------------------------------------------------


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 10 else f"{value:,.0f}"
    return str(value)


PARTS = ("serving", "ddm", "digits", "faults", "hdee-faults", "hdee", "hdee-survey")
GROUPS = {"faults": ("faults", "hdee-faults")}  # --only faults: both fault experiments
ON_REQUEST = ("hdee-survey",)  # parts run only when --only names them


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter runs (a smoke test of the script)")
    parser.add_argument("--skip", default="", help=f"comma list of parts not to run: {','.join(PARTS)}")
    parser.add_argument("--only", default="", help=f"comma list of the parts to run: {','.join(PARTS)}, or a group: "
                        + "; ".join(f"{g} = {','.join(p)}" for g, p in GROUPS.items()))
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=0,
                        help="serving: then this many rounds of meshd (calls coalesced, and not) and hivemind, "
                             "back to back (a shared machine's load changes within a run)")
    parser.add_argument("--hm-python", default="/tmp/hm-venv/bin/python", help="hivemind's venv (../shared/anchors/setup)")
    parser.add_argument("--samples", type=int, default=2000,
                        help="DDM samples per mode (and the grid's held-out points), on the grid and the digits")
    parser.add_argument("--ddm-steps", type=int, default=800,
                        help="training steps per DDM expert and the router on the digits")
    parser.add_argument("--grid-steps", type=int, default=1000,
                        help="training steps per DDM expert and the router on the grid (the monolith: 4x)")
    parser.add_argument("--grid-seeds", type=int, default=3, help="seeds of the grid's run (data, models, sampling)")
    parser.add_argument("--grid-lr", type=float, default=4e-3, help="the grid's learning rate, every model")
    parser.add_argument("--grid-decay", type=float, default=0.3,
                        help="the grid's learning rate falls linearly to 0 over this last fraction of the steps")
    parser.add_argument("--ddm-sample-steps", type=int, default=50, help="Euler steps per sample")
    parser.add_argument("--hdee-seeds", type=int, default=3)
    parser.add_argument("--hdee-first-seed", type=int, default=0,
                        help="hdee: the first seed (another run's seeds after it: a replication on fresh draws)")
    parser.add_argument("--hdee-chars", type=int, default=360_000,
                        help="characters read per text domain (scripts have about 372,000; at 150,000, the "
                             "default before 2026-11-26, the experts overfit their text)")
    parser.add_argument("--hdee-domains", default=HDEE_DOMAINS,
                        help="the trained domains, comma-separated (experts_kit.SURVEY_DOMAINS; chosen by "
                             "--only hdee-survey's rule); code,licenses,changelogs was the first setting")
    parser.add_argument("--hdee-width", type=int, default=128,
                        help="the char LMs' GRU width: the medium size (every homogeneous expert; hdee-faults' LMs)")
    parser.add_argument("--hdee-widths", default="112,144",
                        help="the small and large sizes' widths (133,536 and 199,264 parameters against 164,864: "
                             "the paper's s/m/l were 90M/115M/135M)")
    parser.add_argument("--hdee-seed-steps", type=int, default=200, help="steps of each seed model on the mix")
    parser.add_argument("--hdee-steps", type=int, default=250,
                        help="steps per homogeneous expert (and per medium heterogeneous one)")
    parser.add_argument("--hdee-short", type=float, default=0.75,
                        help="the small expert's steps, a fraction of --hdee-steps (the paper's 300 of 400); the "
                             "large expert's steps make the two arms' compute equal")
    parser.add_argument("--hdee-rule", choices=("tiers", "proportional"), default="proportional",
                        help="how the heterogeneous arm shares compute: the paper's three tiers (--hdee-short), "
                             "or every expert's share in proportion to its domain's hardness")
    parser.add_argument("--hdee-eval", type=int, default=12_000,
                        help="bytes of each test text scored (of about 15,000), and of each dev text the cached "
                             "prior is estimated on")
    parser.add_argument("--hdee-dev", type=int, default=12_000,
                        help="bytes of each domain's dev text a domain's difficulty is measured on (hdee, hdee-survey)")
    parser.add_argument("--fault-tokens", type=int, default=300, help="bytes the hdee-faults part decodes")
    parser.add_argument("--fault-lm-steps", type=int, default=200, help="training steps of each hdee-faults expert")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.samples, args.ddm_steps, args.ddm_sample_steps = 2.0, 600, 200, 20
        args.grid_steps, args.grid_seeds = 100, 2
        args.hdee_seeds, args.hdee_seed_steps, args.hdee_steps, args.hdee_eval = 1, 40, 40, 1000
        args.hdee_dev = 2000
        args.fault_tokens, args.fault_lm_steps = 120, 40
    if args.only:
        wanted = {p for name in args.only.split(",") for p in GROUPS.get(name, (name,))}
        if wanted - set(PARTS):
            parser.error(f"--only: no part {', '.join(sorted(wanted - set(PARTS)))}; the parts: {', '.join(PARTS)}")
        args.skip = ",".join([*args.skip.split(","), *(p for p in PARTS if p not in wanted)])
    else:
        args.skip = ",".join([*args.skip.split(","), *ON_REQUEST])
    stop_on_sigterm()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="meshd-experts-") as tmp:
        root = Path(tmp)
        grid: dict = {}
        digit: dict = {}

        def with_models(part, models: dict, train):
            def run():
                if not models:
                    models.update(train(args))
                return trio.run(part, args, root, models)
            return run

        parts = [("serving", lambda: trio.run(serving, args, root)), ("ddm", with_models(ddm_grid, grid, ddm_models)),
                 ("digits", with_models(digits, digit, digits_models)),
                 ("faults", with_models(faults, grid, lambda a: ddm_models(a, monolith=False))),
                 ("hdee-faults", lambda: trio.run(hdee_faults, args, root)),
                 ("hdee", lambda: trio.run(hdee, args, root)), ("hdee-survey", lambda: hdee_survey(args, root))]
        rows, rc = run_parts(parts, args.skip, lambda name, msg: {"part": name, "what": "FAILED", "detail": msg},
                             {"part": "-", "what": "interrupted"})
    columns = ["part", "what", "rows/s", "p50 ms", "p99 ms", "mmd2", "mmd", "evals", "calls", "classes", "H bits",
               "shares max/min",
               "bpc", "detail"]
    table = Table(title=f"Experts on the mesh, 127.0.0.1, {torch.get_num_threads()} torch thread(s) "
                        f"(run took {time.perf_counter() - started:.0f} s)", title_justify="left")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(fmt(row.get(c)) for c in columns))
    Console(width=200).print(table)
    save_json(args.json, {"args": vars(args), "rows": rows, "ddm_samples": SAMPLES})
    return rc


if __name__ == "__main__":
    sys.exit(main())
