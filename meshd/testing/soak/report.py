"""The soak's printout: what it ran, what it did, what it checked (rich tables)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from .run import SoakReport


def print_report(report: SoakReport, console: Console | None = None) -> None:
    """Print the run's shape, one row per cluster and kind of work, the chaos, and every check."""
    console = console or Console()
    daemons = sum(len(cluster.slots) for cluster in report.clusters)
    console.print(f"[bold]soak[/]: {daemons} daemons in {len(report.clusters)} cluster(s) "
                  f"({', '.join(f'{c.name} {len(c.slots)}' for c in report.clusters)}), "
                  f"{report.plan.duration:.0f} s of work, {report.wall:.0f} s wall "
                  f"({', '.join(f'{name} {s:.0f} s' for name, s in report.phases.items())}), seed {report.plan.seed}")

    work = Table(title="what it did")
    for column in ("cluster", "operation", "acknowledged", "failed (chaos)"):
        work.add_column(column, justify="left" if column in ("cluster", "operation", "failed (chaos)") else "right")
    for cluster in report.clusters:
        for kind, tally in sorted(report.ledgers[cluster.name].ops.items()):
            failed = ", ".join(f"{n} {name}" for name, n in tally.failed.most_common()) or "-"
            work.add_row(cluster.name, kind, str(tally.ok), failed)
    chaos = report.chaos
    work.add_row("all", "SIGKILL", str(chaos.kills), f"{chaos.mid_operation} with an operation in flight")
    work.add_row("all", "restart", str(chaos.restarts), "; ".join(chaos.restart_failures) or "-")
    work.add_row("all", "link cut + restore", str(chaos.cuts), ", ".join(sorted(set(chaos.cut_names))) or "-")
    console.print(work)
    for cluster in report.clusters:
        for kind, tally in sorted(report.ledgers[cluster.name].ops.items()):
            for error, message in tally.example.items():
                console.print(f"  {cluster.name} {kind}, first {error}: {message}", highlight=False)

    checks = Table(title="what it checked")
    for column in ("check", "verdict", "what it saw"):
        checks.add_column(column)
    for check in report.checks:
        checks.add_row(check.name, "[green]pass[/]" if check.passed else "[red]FAIL[/]", check.detail)
    console.print(checks)
