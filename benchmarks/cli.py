"""meshctl start-up: wall time of whole commands against one idle daemon.

    .venv/bin/python benchmarks/cli.py [--runs 20]

Starts one daemon on 127.0.0.1 (no STUN, no port mapping), creates a document,
lets the daemon settle, then runs each command below ``--runs`` times as a
real process, round-robin so that a busy moment on the machine falls on every
row alike, and prints p50 and p95 of the wall time from spawn to exit.  The
floor is ``python -c pass`` with the same interpreter in the same run;
``import trio`` is there to show what a command would pay for it (the CLI
does without, docs/performance.md).  About 20 s on 2 cores.

Bytecode: the rows run as an installed meshctl does, with compiled modules
cached (here under a private ``PYTHONPYCACHEPREFIX``).  One more row runs
``meshctl status`` with this shell's own settings: where
``PYTHONDONTWRITEBYTECODE`` is set and the checkout has no ``__pycache__``,
every run compiles the CLI's and the client's sources again (~40 ms).

Target: ``meshctl --help``, ``status`` and ``crdt inc`` each ≤ 150 ms at p50.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

# The repo, not this folder, comes first: this file would shadow the cli package.
REPO = Path(__file__).resolve().parent.parent
sys.path[:1] = [str(REPO)]
from benchmarks.dht import pct  # noqa: E402
from benchmarks.parts import log, stop_on_sigterm  # noqa: E402
from meshd.testing.localmesh import Daemon  # noqa: E402

TARGET_MS = 150.0
SETTLE_S = 2.0  # after start: the daemon's first background work (DHT, NAT) is done


def meshctl_command() -> list[str]:
    """``meshctl`` as a user runs it: the console script beside this interpreter,
    else ``python -m cli.meshctl``."""
    script = Path(sys.executable).parent / "meshctl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "cli.meshctl"]


Row = tuple[str, list[str], dict, bool]  # label, argv, environment, has the target


def commands(data_dir: Path, cached: dict, as_is: dict) -> list[Row]:
    """The rows: the floor first, ``cached`` bytecode but for the last row (``as_is``)."""
    meshctl = [*meshctl_command(), "--data-dir", str(data_dir)]
    compiled = "sources compiled each run" if "PYTHONDONTWRITEBYTECODE" in as_is else "may write bytecode"
    return [
        ("python -c pass (floor)", [sys.executable, "-c", "pass"], cached, False),
        ("python -c 'import trio' (reference)", [sys.executable, "-c", "import trio"], cached, False),
        ("meshctl --help", [*meshctl, "--help"], cached, True),
        ("meshctl status", [*meshctl, "status"], cached, True),
        ("meshctl crdt inc bench steps", [*meshctl, "crdt", "inc", "bench", "steps", "1"], cached, True),
        (f"meshctl status, this shell's bytecode settings ({compiled})", [*meshctl, "status"], as_is, False),
    ]


def timed(argv: list[str], env: dict) -> float:
    """Seconds from spawn to exit; RuntimeError if the command fails."""
    start = time.perf_counter()
    out = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                         timeout=60)
    elapsed = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {out.returncode}: {out.stderr.strip()[:200]}")
    return elapsed


def measure(rows: list[Row], runs: int) -> dict[str, list[float]]:
    for _, argv, env, _ in rows:  # one untimed run each: bytecode and page cache warm
        timed(argv, env)
    samples: dict[str, list[float]] = {label: [] for label, *_ in rows}
    for _ in range(runs):
        for label, argv, env, _ in rows:
            samples[label].append(timed(argv, env))
    return samples


def print_table(rows: list[Row], samples: dict[str, list[float]], title: str) -> None:
    floor = pct(samples[rows[0][0]], 50) * 1e3
    table = Table(title=title)
    for col in ("command", "p50 ms", "p95 ms", "p50 - floor", "target"):
        table.add_column(col, justify="left" if col in ("command", "target") else "right")
    for label, _, _, targeted in rows:
        p50, p95 = pct(samples[label], 50) * 1e3, pct(samples[label], 95) * 1e3
        target = ""
        if targeted:
            target = f"≤ {TARGET_MS:g} ms " + ("[green]met[/]" if p50 <= TARGET_MS else "[red]MISSED[/]")
        table.add_row(label, f"{p50:,.1f}", f"{p95:,.1f}", "" if label == rows[0][0] else f"{p50 - floor:+,.1f}",
                      target)
    Console(width=160).print(table)
    print("Wall time of each command as a child process, spawn to exit, output to /dev/null; the daemon idle\n"
          "but for these commands.  p50 - floor: what the command costs beyond starting this interpreter.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="timed runs of each command (default 20)")
    args = parser.parse_args()
    os.chdir(REPO)  # the daemon runs `python -m`, which puts the working directory first on sys.path
    stop_on_sigterm()
    path = os.environ.get("PYTHONPATH")
    as_is = dict(os.environ, PYTHONPATH=str(REPO) + (os.pathsep + path if path else ""), COLUMNS="120")
    with tempfile.TemporaryDirectory(prefix="meshd-cli-bench-") as tmp:
        cached = {k: v for k, v in as_is.items() if k != "PYTHONDONTWRITEBYTECODE"}
        cached["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        daemon = Daemon(Path(tmp) / "d0", config={"nat": {"port_mapping": False, "stun_servers": []}}, env=as_is)
        try:
            log("[cli] starting a daemon ...")
            daemon.start(timeout=30)
            daemon.meshctl("crdt", "create", "bench")
            time.sleep(SETTLE_S)
            rows = commands(daemon.data_dir, cached, as_is)
            log(f"[cli] {len(rows)} commands x {args.runs} runs ...")
            samples = measure(rows, args.runs)
        except KeyboardInterrupt:
            log("interrupted: the daemon has been stopped")
            return 130
        finally:
            if daemon.stop() not in (0, -15):
                log(f"the daemon did not exit cleanly: {daemon.tail_log()}")
    print_table(rows, samples, f"meshctl start-up against one idle daemon, {args.runs} runs each, round-robin "
                               f"({os.cpu_count()} CPUs, Python {sys.version.split()[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
