"""Live abuse benchmark: a real daemon under each attack, and all of them together.

    .venv/bin/python benchmarks/abuse.py [--quiet 4] [--attack 4] [--only call_flood,...]

For every attack of ``meshd.testing.attacks`` (then all at once) a fresh
``meshd`` daemon is started and pinned to one core; the attacker process is
pinned to the other at the lowest priority (nice 19), beside this process,
the honest peer (a ping of 128 bytes every 5 ms over its own connection), so
the honest peer's own calls never wait for the attacker's CPU.  The table gives the
honest p50/p99 while the daemon is quiet and while it is attacked, their
ratio (the target: p99 within 3x of the quiet value), failed honest calls,
how long a newcomer took to connect during the attack, the daemon's RSS
before, at its peak and after, and what the attacker managed.  The machine's
load is printed with the table: on shared cores the numbers move with it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

# The repo, not this folder, comes first: benchmarks/nat.py would shadow the nat package.
sys.path[:1] = [str(Path(__file__).resolve().parents[1])]
from meshd.testing.abuse import Phase, run_phase_sync, wall_clock  # noqa: E402
from meshd.testing.attacks import ATTACKS  # noqa: E402

P99_TARGET = 3.0  # honest p99 under attack / quiet p99


def _row(phase: Phase) -> list[str]:
    quiet99, hit99 = phase.quiet.quantile(0.99), phase.attacked.quantile(0.99)
    ratio = hit99 / quiet99
    counters = ", ".join(f"{k} {v}" for k, v in sorted(phase.attacker.items()))
    name = "all together" if len(phase.attacks) > 1 else phase.attacks[0]
    newcomer = "refused" if phase.new_peer_s is None else f"{1000 * phase.new_peer_s:.0f} ms"
    return [
        name,
        f"{phase.quiet.quantile(0.5):.2f} / {quiet99:.2f}",
        f"{phase.attacked.quantile(0.5):.2f} / {hit99:.2f}",
        f"[{'green' if ratio <= P99_TARGET else 'red'}]{ratio:.1f}x[/]",
        f"{phase.attacked.failed} of {phase.attacked.failed + len(phase.attacked.seconds)}",
        newcomer,
        f"{phase.rss_before_kib >> 10} / {phase.rss_peak_kib >> 10} / {phase.rss_after_kib >> 10}",
        "yes" if phase.alive else "[red]NO[/]",
        counters,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quiet", type=float, default=4.0, help="seconds of honest calls before the attack")
    parser.add_argument("--attack", type=float, default=4.0, help="seconds of honest calls under attack")
    parser.add_argument("--only", help="comma-separated attacks (default: each, then all together)")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(ATTACKS)
    unknown = [name for name in names if name not in ATTACKS]
    if unknown:
        parser.error(f"unknown attack {', '.join(unknown)} (known: {', '.join(ATTACKS)})")
    console = Console(width=200)
    table = Table(title=f"meshd under attack ({wall_clock()} at start)")
    for column in ("attack", "quiet p50 / p99 ms", "attacked p50 / p99 ms", "p99 ratio", "failed",
                   "newcomer", "RSS MiB before / peak / after", "alive", "attacker counters"):
        table.add_column(column, overflow="fold")
    phases = [[name] for name in names] + ([names] if len(names) > 1 else [])
    for attacks in phases:
        phase = run_phase_sync(attacks, quiet_s=args.quiet, attack_s=args.attack)
        table.add_row(*_row(phase))
        console.print(f"{','.join(attacks)} done ({wall_clock()})")
    console.print(table)
    console.print(f"at the end: {wall_clock()}")


if __name__ == "__main__":
    main()
