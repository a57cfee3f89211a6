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
    beside = []
    if report.training is not None:
        beside.append(f"{report.training.plan.members} training members")
    if report.experts is not None:
        beside.append(f"{report.experts.plan.servers} expert servers and a caller")
    console.print(f"[bold]soak[/]: {daemons} daemons in {len(report.clusters)} cluster(s) "
                  f"({', '.join(f'{c.name} {len(c.slots)}' for c in report.clusters)})"
                  + (f" + {' + '.join(beside)}" if beside else "") + ", "
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
    for row in script_rows(report):
        work.add_row(*row)
    console.print(work)
    for cluster in report.clusters:
        for kind, tally in sorted(report.ledgers[cluster.name].ops.items()):
            for error, message in tally.example.items():
                console.print(f"  {cluster.name} {kind}, first {error}: {message}", highlight=False)
    if report.experts is not None:
        firsts: dict[str, str] = {}
        for call in report.experts.calls:
            if call.error:
                firsts.setdefault(call.error, call.message)
        for error, message in firsts.items():
            console.print(f"  expert call, first {error}: {message}", highlight=False)

    checks = Table(title="what it checked")
    for column in ("check", "verdict", "what it saw"):
        checks.add_column(column)
    for check in report.checks:
        checks.add_row(check.name, "[green]pass[/]" if check.passed else "[red]FAIL[/]", check.detail)
    console.print(checks)


def script_rows(report: SoakReport) -> list[tuple[str, str, str, str]]:
    """Rows of "what it did" for the script processes: training rounds, expert calls, their kills."""
    from .expert_calls import AFTER, DOWN, RESTARTING
    from .training import longest_round

    rows = []
    host = next((cluster.name for cluster in report.clusters if cluster.local), "-")
    if report.training is not None:
        log, plan = report.training, report.training.plan
        rows.append((host, f"DiLoCo round ({plan.members} members, H={plan.inner_steps})",
                      str(len(log.reports())), f"longest round {longest_round(log):.1f} s"))
        back = "restarted on its data dir" if plan.same_identity else "a new member joined"
        rows.append((host, "member SIGKILL + restart", str(int(log.killed_at is not None)),
                     f"{log.victim} at round {log.killed_at}, {back}, reporting from round {log.back_at}"
                     if log.killed_at is not None else "-"))
    if report.experts is not None:
        log = report.experts
        answered = sum(call.peer is not None for call in log.calls)
        failed = ", ".join(f"{n} {name}" for name, n in log.errors().most_common()) or "-"
        rows.append((host, f"expert call ({log.plan.servers} servers)", str(answered), failed))
        if log.killed is not None:
            down = sum(call.phase == DOWN for call in log.calls)
            after = sum(call.phase in (RESTARTING, AFTER) for call in log.calls)
            restarted = any(script.name == log.killed + "'" and script.ready for script in log.scripts)
            rows.append((host, "expert server SIGKILL + restart", "1",
                         f"{log.killed} after {log.killed_after} calls; {down} calls while it was down"
                         + (f"; restarted, {after} calls since it was started again" if restarted
                            else "; not restarted")))
    return rows
