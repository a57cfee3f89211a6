"""benchmarks/all.py's page: ``--keep`` carries the benchmarks a run leaves out over from the page before."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "all.py"


@pytest.fixture(scope="module")
def bench_all():
    spec = importlib.util.spec_from_file_location("bench_all", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_all"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _result(bench_all, name: str, output: str, when: str):
    bench = next(b for b in bench_all.BENCHES if b.name == name)
    return bench_all.Result(bench, f"benchmarks/{bench.script}", 12.0, 0, output, "0.10", "0.20", None, when)


def test_a_kept_benchmark_keeps_its_row_section_and_plot_beside_the_new_run(bench_all):
    first = bench_all.page([_result(bench_all, "rpc", "rpc table", "2026-11-26 18:00, 1234abc"),
                            _result(bench_all, "cli", "old cli table", "2026-11-26 18:02, 1234abc")],
                           [("RPC latency", "rpc.png")], False, "benchmarks")
    kept = bench_all.kept_from(first, {"rpc", "dht"})
    second = bench_all.page([_result(bench_all, "cli", "new cli table", "2026-11-26 20:00, 5678def")], [], False,
                            "benchmarks", kept)

    assert "| rpc | `benchmarks/rpc.py` | 12 s | 0 | 0.10 | 0.20 | 2026-11-26 18:00, 1234abc |" in second
    assert "| cli | `benchmarks/cli.py` | 12 s | 0 | 0.10 | 0.20 | 2026-11-26 20:00, 5678def |" in second
    assert "![RPC latency](benchmarks/rpc.png)" in second
    assert "rpc table" in second and "new cli table" in second and "old cli table" not in second
    assert second.index("## rpc") < second.index("## cli")  # the benchmarks' own order
    assert "dht" not in second  # nothing is made up for a benchmark neither page ran


def test_a_row_from_a_page_without_run_cells_takes_the_pages_date_and_commit(bench_all):
    old = ("# Benchmarks\n\nWritten by `benchmarks/all.py` on 2026-11-26 18:24 UTC.\n\n"
           "| machine | |\n|---|---|\n| commit | 72520ad |\n\n"
           "| benchmark | command | took | exit | load before | load after |\n|---|---|---|---|---|---|\n"
           "| nat | `benchmarks/nat.py` | 148 s | 0 | 0.33 | 0.40 | (rerun alone)\n\n## nat\n\nnat table\n")
    kept = bench_all.kept_from(old, {"nat"})
    assert kept.rows["nat"] == ["`benchmarks/nat.py`", "148 s", "0", "0.33", "0.40", "2026-11-26 18:24, 72520ad"]
    assert kept.sections["nat"] == "## nat\n\nnat table"


def test_the_benchmarks_still_to_run_are_named_under_the_pages_date(bench_all):
    text = bench_all.page([_result(bench_all, "rpc", "rpc table", "2026-11-26 18:00, 1234abc")], [], False,
                          "benchmarks", None, ["cli", "dht"])
    head = text.split("\n\n")
    assert head[0] == "# Benchmarks"
    assert head[1].startswith("Written by ") and head[1].endswith("Still to run when this page was written: cli, dht.")
    assert "Still to run" not in bench_all.page([_result(bench_all, "rpc", "t", "2026-11-26 18:00, 1234abc")], [],
                                                False, "benchmarks")
