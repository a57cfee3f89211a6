"""Every benchmark in one command, written to ``docs/benchmarks.md`` with plots.

    .venv/bin/python benchmarks/all.py [--quick] [--only rpc,dht,...] [--keep] [--out docs/benchmarks.md]

Runs each benchmark script in turn as its own process (the anchors' rows come
from the same scripts, in the same runs), keeps its table as printed, and
writes one page: the date, the commit, the machine (CPU, cores, memory,
kernel, Python), the load before and after each benchmark, how long each took
and its table; then plots from the scripts' JSON where a picture says more
(latency distributions, throughput by path).  ``--quick`` passes each script
its short settings: a smoke test of the page, not numbers to quote.  ``--keep``
keeps, from the page already there, the rows, plots and tables of the benchmarks
this run leaves out (each row says when and at which commit it ran), so a page can
be filled by runs on different days.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


@dataclass
class Bench:
    """One script: its arguments (full and quick), whether it writes ``--json``, a time limit."""

    name: str
    script: str
    args: list[str] = field(default_factory=list)
    quick: list[str] = field(default_factory=list)
    json: bool = False
    timeout: float = 1800.0


BENCHES = [  # the network's, then the AI half's: the longest (learning) last
    Bench("rpc", "rpc.py", quick=["--calls", "500", "--bulk-mib", "64", "--no-anchors"], json=True),
    Bench("cli", "cli.py", quick=["--runs", "5"]),
    Bench("dht", "dht.py", quick=["--skip", "sim,anchors", "--daemons", "8", "--ops", "30"], json=True),
    Bench("crdt", "crdt.py", quick=["--quick"]),
    Bench("lane", "lane.py", quick=["--runs", "1"]),
    Bench("shards", "shards.py", quick=["--quick", "--skip", "anchors"], json=True),
    Bench("pmtu", "pmtu.py", quick=["--mib", "16", "--runs", "1"]),
    Bench("lan", "lan.py", quick=["--mib", "8", "--runs", "1"]),
    Bench("nat", "nat.py", quick=["--runs", "1", "--pairs", "home-home,symmetric-home"]),
    Bench("metrics", "metrics.py", quick=["--calls", "200", "--rounds", "2"]),
    Bench("abuse", "abuse.py", quick=["--quiet", "2", "--attack", "2", "--only", "garbage,call_flood"]),
    Bench("experts", "experts.py", quick=["--quick"], json=True),
    Bench("learning_throughput", "learning_throughput.py", quick=["--mib", "32", "--syncs", "1", "--skip", "hivemind"]),
    Bench("learning_client", "learning_client.py", quick=["--mib", "16", "--syncs", "2"]),
    Bench("learning", "learning.py", quick=["--quick"], json=True),
    Bench("learning_charlm", "learning_charlm.py", quick=["--quick"]),
    Bench("learning_churn", "learning_churn.py", quick=["--quick"]),
    Bench("learning_robust", "learning_robust.py", quick=["--quick"]),
    Bench("learning_islands", "learning_islands.py", quick=["--steps", "100"]),
    Bench("learning_sim", "learning_sim.py", quick=["--quick"]),
]


def machine() -> dict[str, str]:
    """What the numbers were measured on."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    mem = next((line.split()[1] for line in _read("/proc/meminfo").splitlines() if line.startswith("MemTotal")), "0")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    return {"CPU": cpu, "cores": str(os.cpu_count()), "memory": f"{int(mem) / 2**20:.1f} GiB",
            "kernel": platform.release(), "Python": platform.python_version(), "commit": commit}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@dataclass
class Result:
    bench: Bench
    command: str
    seconds: float
    returncode: int
    output: str
    load_before: str
    load_after: str
    data: dict | None
    when: str = ""  # UTC, when it started


def run(bench: Bench, quick: bool, scratch: Path) -> Result:
    """Run one benchmark; its output (stderr's tail too if it failed) and JSON."""
    args = list(bench.args) + (bench.quick if quick else [])
    json_path = scratch / f"{bench.name}.json"
    if bench.json:
        args += ["--json", str(json_path)]
    command = [PYTHON, str(ROOT / "benchmarks" / bench.script), *args]
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    load_before, start, when = _load(), time.perf_counter(), f"{_now()}, {machine()['commit']}"
    print(f"== {bench.name}: {' '.join(command[1:])}", flush=True)
    try:
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=bench.timeout)
        output, code = proc.stdout, proc.returncode
        if code:
            output += "\n" + "\n".join(proc.stderr.splitlines()[-15:])
    except subprocess.TimeoutExpired as exc:
        output, code = f"{exc.stdout or ''}\n(stopped after {bench.timeout:.0f} s)", -1
    seconds = time.perf_counter() - start
    data = json.loads(json_path.read_text()) if bench.json and json_path.exists() else None
    shown = " ".join(["benchmarks/" + bench.script, *[a for a in args if not a.startswith(str(scratch))]])
    shown = shown.replace(" --json", "")
    print(f"   {seconds:.0f} s, exit {code}", flush=True)
    return Result(bench, shown, seconds, code, output, load_before, _load(), data, when)


def _now() -> str:
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"


# --- a page kept from an earlier run -------------------------------------------------------


@dataclass
class Kept:
    """What an earlier page holds of the benchmarks this run leaves out: per name its table
    row's cells (command, took, exit, load before, load after, run: "date, commit"), its
    section and its plots."""

    rows: dict[str, list[str]] = field(default_factory=dict)
    sections: dict[str, str] = field(default_factory=dict)
    plots: dict[str, list[str]] = field(default_factory=dict)


def kept_from(text: str, leave: set[str]) -> Kept:
    """The parts of page ``text`` (as :func:`page` writes it) for the benchmarks named in
    ``leave``.  A row without a "run" cell takes the page's own date and commit."""
    written = re.search(r" on (\d{4}-\d\d-\d\d \d\d:\d\d) UTC", text)
    commit = re.search(r"^\| commit \| (\w+) \|", text, re.M)
    page_run = f"{written.group(1) if written else '?'}, {commit.group(1) if commit else '?'}"
    kept = Kept()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in leave and len(cells) >= 6:
            dated = len(cells) > 6 and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d, \w+", cells[6])
            kept.rows[cells[0]] = cells[1:6] + [cells[6] if dated else page_run]
        image = re.fullmatch(r"!\[.*\]\([^)]*/([a-z_]+)(?:-\d+)?\.png\)", line)
        if image and image.group(1) in leave:
            kept.plots.setdefault(image.group(1), []).append(line)
    for section in re.split(r"\n(?=## )", text)[1:]:
        name = section.split("\n", 1)[0][3:].strip()
        if name in leave:
            kept.sections[name] = section.rstrip()
    return kept


# --- plots ---------------------------------------------------------------------------


def plot(results: list[Result], folder: Path) -> list[tuple[str, str]]:
    """PNG plots for the results that carry data: ``[(title, file name)]``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    made = []
    for result in results:
        if result.data is None:
            continue
        for i, maker in enumerate(PLOTS.get(result.bench.name, [])):
            fig, ax = plt.subplots(figsize=(8, 4.2))
            title = maker(ax, result.data)
            if title is None:
                plt.close(fig)
                continue
            ax.set_title(title)
            fig.tight_layout()
            name = f"{result.bench.name}{f'-{i}' if i else ''}.png"
            fig.savefig(folder / name, dpi=110)
            plt.close(fig)
            made.append((title, name))
    return made


def _cdf(ax, values: list[float], label: str) -> None:
    values = sorted(values)
    if values:
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)


def _plot_rpc(ax, data: dict) -> str | None:
    rows = [r for r in data.get("rows", []) if r.get("p50_ms") is not None]
    if not rows:
        return None
    for i, row in enumerate(rows):
        if row.get("lat_ms"):
            _cdf(ax, row["lat_ms"], row["name"])
        else:
            ax.axvline(row["p50_ms"], linestyle=":", color=f"C{i}", label=f"{row['name']}: p50")
    ax.set_xscale("log")
    ax.set_xlabel("unary call latency, ms (log)")
    ax.set_ylabel("fraction of calls")
    ax.legend(fontsize=7, loc="lower right")
    return "Unary RPC latency: meshd's distribution, other systems' p50"


def _plot_dht(ax, data: dict) -> str | None:
    runs = data.get("real") or []
    if not runs:
        return None
    biggest = max(runs, key=lambda r: r.get("daemons", 0))
    for key, measure, label in (("live", "put_lat", "put"), ("live", "get_lat", "get"),
                                ("dead", "get_lat", "get, first pass after 30 % killed")):
        _cdf(ax, [x * 1e3 for x in (biggest.get(key) or {}).get(measure, [])], f"meshd {label}")
    anchors = [row for row in data.get("rows", [])
               if "meshd" not in row.get("system", "") and row.get("p50") is not None and row.get("unit") == "ms"]
    for i, row in enumerate(anchors, start=3):
        ax.axvline(row["p50"], linestyle=":", color=f"C{i}", label=f"{row['system']} {row['measure']}: p50")
    ax.set_xscale("log")
    ax.set_xlabel("latency, ms (log)")
    ax.set_ylabel("fraction of operations")
    ax.legend(fontsize=7, loc="lower right")
    return f"DHT on {biggest.get('daemons')} daemons: latency distributions, anchors' p50"


def _plot_shards(ax, data: dict) -> str | None:
    rows = [r for r in data.get("rows", []) if r.get("mb_s")]
    if not rows:
        return None
    labels = [f"{r['part']}: {r['measure']}"[:70] for r in rows]
    ax.barh(range(len(rows)), [r["mb_s"] for r in rows])
    ax.set_yticks(range(len(rows)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("MB/s")
    return "Model shards: publish and fetch rates beside the disk and the anchors"


def _plot_gossip(ax, data: dict) -> str | None:
    curves = [c for c in data.get("gossip", []) if c["split"] == "IID"]
    if not curves:
        return None
    rounds = range(1, len(curves[0]["acc"]) + 1)
    ax.plot(rounds, curves[0]["fedavg"], "k--", label="FedAvg (central, common init)")
    for curve in curves:
        ax.plot(rounds, curve["acc"], marker=".", label=f"gossip, {curve['rule']}")
    ax.set_xlabel("round")
    ax.set_ylabel("members' mean test accuracy")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, loc="lower right")
    return "Gossip on digits, own random inits, IID: accuracy by round beside FedAvg"


def _plot_diloco(ax, data: dict) -> str | None:
    rows = [r for r in data.get("diloco", []) if r["model"] == "mlp" and r["split"] == "IID"]
    if not rows:
        return None
    for r in rows:
        ax.scatter(r["bytes"] / 1e6, r["acc"], color="k" if "data parallel" in r["run"] else "C0")
        ax.annotate(r["run"], (r["bytes"] / 1e6, r["acc"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("MB each member sent (log)")
    ax.set_ylabel("test accuracy")
    return "DiLoCo on digits, 4 members: accuracy against bytes sent, beside data parallel"


def _plot_experts_ddm(ax, data: dict) -> str | None:
    samples = data.get("ddm_samples") or {}
    if not samples:
        return None
    ax.axis("off")
    ax.figure.set_size_inches(8, 5.6)
    names = list(samples)
    columns = (len(names) + 1) // 2
    scores = {r["what"].split()[1]: r.get("mmd2") for r in data.get("rows", [])
              if r.get("part") == "ddm" and r.get("what", "").startswith("DDM ")}
    scores.update({"monolith": r.get("mmd2") for r in data.get("rows", [])
                   if r.get("part") == "ddm" and r.get("what", "").startswith("monolith")})
    for i, name in enumerate(names):
        panel = ax.inset_axes([(i % columns) / columns + 0.01, 0.53 - 0.52 * (i // columns),
                               1 / columns - 0.02, 0.43])
        points = samples[name]
        panel.scatter([p[0] for p in points], [p[1] for p in points], s=1.5, color="k" if i == 0 else f"C{i}")
        score = scores.get(name)
        panel.set_title(name + (f": MMD² {score:.4f}" if score is not None else ""), fontsize=8)
        panel.set_xlim(-2.2, 2.2)
        panel.set_ylim(-2.2, 2.2)
        panel.set_aspect("equal")
        panel.set_xticks([-1.5, -0.5, 0.5, 1.5], [])
        panel.set_yticks([-1.5, -0.5, 0.5, 1.5], [])
        panel.grid(alpha=0.3)
    return "DDM on the 4x4 grid: held-out data and each mode's samples (seed 0; MMD²: the seeds' mean)"


def _plot_experts_serving(ax, data: dict) -> str | None:
    rows = [r for r in data.get("rows", []) if r.get("part") == "serving" and r.get("rows/s")]
    if not rows:
        return None
    ax.barh(range(len(rows)), [r["rows/s"] for r in rows],
            color=["0.6" if "in process" in r["what"] else "C1" if "hivemind" in r["what"] else "C0" for r in rows])
    labels = [re.sub(r",? \d+ callers( asking all 4)?", "", r["what"]).replace("1 expert in its own process", "meshd")
              for r in rows]
    ax.set_yticks(range(len(rows)), [label[:45] for label in labels], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("rows/s (4 experts: requests/s, each asking all 4)")
    return f"Expert serving, {(data.get('args') or {}).get('callers', '?')} callers: rows/s"


PLOTS = {"rpc": [_plot_rpc], "dht": [_plot_dht], "shards": [_plot_shards], "learning": [_plot_diloco, _plot_gossip],
         "experts": [_plot_experts_ddm, _plot_experts_serving]}


# --- the page ------------------------------------------------------------------------


def page(results: list[Result], plots: list[tuple[str, str]], quick: bool, plot_dir: str,
         kept: Kept | None = None, pending: list[str] = ()) -> str:
    """The page: when and how it was written (and the benchmarks of the run still
    ``pending``), the machine, one row per benchmark (this run's, and ``kept``'s from
    the page before for those it left out), the plots, then each benchmark's output."""
    facts, kept = machine(), kept or Kept()
    ran = {r.bench.name: r for r in results}
    rows = {r.bench.name: [f"`{r.command}`", f"{r.seconds:.0f} s", str(r.returncode), r.load_before,
                           r.load_after, r.when] for r in results}
    order = [b.name for b in BENCHES if b.name in ran or b.name in kept.rows or b.name in kept.sections]
    lines = ["# Benchmarks", "",
             f"Written by `benchmarks/all.py{' --quick' if quick else ''}` on {_now()} UTC"
             + (" (quick settings: a smoke test, not numbers to quote)." if quick else "."),
             "Each benchmark ran alone, one after another; every table holds its comparison rows "
             "(anchors, ceilings) from the same run."
             + (" Rows whose run is earlier were kept from the page before (`--keep`)." if kept.rows else "")
             + (f" Still to run when this page was written: {', '.join(pending)}." if pending else ""), "",
             "| machine | |", "|---|---|", *[f"| {k} | {v} |" for k, v in facts.items()], "",
             "| benchmark | command | took | exit | load before | load after | run (UTC, commit) |",
             "|---|---|---|---|---|---|---|",
             *[f"| {name} | {' | '.join(rows.get(name) or kept.rows.get(name, ['-'] * 6))} |"
               for name in order], ""]
    images = {name: [f"![{title}]({plot_dir}/{file})" for title, file in plots
                     if re.sub(r"(-\d+)?\.png$", "", file) == name] for name in ran}
    for name in order:
        for image in images.get(name) or ([] if name in ran else kept.plots.get(name, [])):
            lines += [image, ""]
    for name in order:
        if name in ran:
            r = ran[name]
            lines += [f"## {name}", "", f"`{r.command}`, {r.seconds:.0f} s, exit {r.returncode}", "",
                      "```text", r.output.rstrip(), "```", ""]
        elif name in kept.sections:
            lines += [kept.sections[name], ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each script's short settings")
    parser.add_argument("--only", default="", help="comma list of: " + ",".join(b.name for b in BENCHES))
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--keep", action="store_true",
                        help="keep the rows, sections and plots of the benchmarks this run leaves out from --out")
    args = parser.parse_args()
    chosen = [b for b in BENCHES if not args.only or b.name in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - {b.name for b in BENCHES}
    if unknown:
        parser.error(f"no benchmark named {', '.join(sorted(unknown))}")
    out = Path(args.out)
    leave = {b.name for b in BENCHES} - {b.name for b in chosen}
    kept = kept_from(out.read_text(), leave) if args.keep and out.exists() else Kept()
    results: list[Result] = []
    plots: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for bench in chosen:  # the page is rewritten after each, so a run cut short keeps what it measured
            results.append(run(bench, args.quick, Path(scratch)))
            plots = write(out, results, [b.name for b in chosen[len(results):]], args.quick, kept)
    print(f"wrote {out} and {len(plots)} plots in {out.parent / out.stem}")
    return max((abs(r.returncode) for r in results), default=0)


def write(out: Path, results: list[Result], pending: list[str], quick: bool,
          kept: Kept | None = None) -> list[tuple[str, str]]:
    """Write the page (and its plots) for ``results`` and ``kept``, naming the benchmarks still to run."""
    plots = plot(results, out.parent / out.stem)
    out.write_text(page(results, plots, quick, out.stem, kept, pending))
    return plots


if __name__ == "__main__":
    sys.exit(main())
