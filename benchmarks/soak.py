"""The long chaos soak: 30 daemons on loopback and a few in the NAT lab, minutes of mixed work.

    .venv/bin/python benchmarks/soak.py [--quick] [--nodes 30] [--lab-hosts 3] [--duration 300] [--seed 0] ...

Document writes, DHT puts and gets, model publishes and fetches run against
random live daemons while the chaos SIGKILLs and restarts one every few
seconds and cuts a NAT host's link for a while (the lab needs root; without
it, or with ``--lab-hosts 0``, the loopback cluster runs alone).  Beside the
loopback cluster, ``--members`` DiLoCo member processes train one group (one
SIGKILLed at round ``--member-kill-at`` and restarted) and ``--expert-servers``
processes serve one expert to a caller calling it throughout (the server in
use SIGKILLed and restarted).  At the end it checks that every acknowledged
write is on every replica, every completed fetch verified, every live training
member on the same hash after its last round, every expert call answered
correctly or failed cleanly, no process crashed and every daemon's peak RSS is
under ``--rss-bound`` MiB, prints what it did and what it checked
(docs/soak.md), and exits 1 if a check failed.  The load average before and after is
printed: the machine is shared.  ``tests/daemon/test_soak.py`` is the short
version.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:1] = [str(REPO), str(REPO / "tests" / "support")]  # the repo first: benchmarks/nat.py shadows nat


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    from meshd.testing.soak import ChaosPlan, SoakPlan

    plan, chaos = SoakPlan(), ChaosPlan()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a smaller run: 12 daemons on loopback, 3 lab hosts, 150 s (the rest as given)")
    p.add_argument("--nodes", type=int, default=30, help="daemons on loopback (default 30)")
    p.add_argument("--lab-hosts", type=int, default=3, help="NAT hosts in the lab, 0 for none (default 3)")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of work under chaos (default 300)")
    p.add_argument("--writers", type=int, default=4, help="document writers per cluster (default 4)")
    p.add_argument("--dht-workers", type=int, default=2, help="DHT put+get loops per cluster (default 2)")
    p.add_argument("--fetchers", type=int, default=2, help="model fetch loops per cluster (default 2)")
    p.add_argument("--kill-every", type=float, default=chaos.kill_every, help="seconds between SIGKILLs")
    p.add_argument("--down-time", type=float, default=chaos.down_time, help="seconds a killed daemon stays down")
    p.add_argument("--max-down", type=int, default=3, help="daemons down at once, at most (default 3)")
    p.add_argument("--cut-every", type=float, default=chaos.cut_every, help="seconds between link cuts")
    p.add_argument("--cut-time", type=float, default=chaos.cut_time, help="seconds a link stays cut")
    p.add_argument("--converge-timeout", type=float, default=120.0, help="bound on the convergence wait (s)")
    p.add_argument("--rss-bound", type=int, default=plan.rss_bound_mib, help="MiB per daemon (peak RSS)")
    p.add_argument("--model-mib", type=int, default=8, help="size of the published model (MiB)")
    p.add_argument("--members", type=int, default=3, help="DiLoCo member processes, 0 for no training (default 3)")
    p.add_argument("--train-steps", type=int, default=20000,
                   help="inner steps each member takes at most (default 20000): the members end together a few "
                        "rounds after the restarted one is back in, whatever the machine's speed")
    p.add_argument("--inner-steps", type=int, default=50, help="H, inner steps per outer round (default 50)")
    p.add_argument("--member-kill-at", type=int, default=5, help="the round at which a member is SIGKILLed")
    p.add_argument("--expert-servers", type=int, default=2, help="expert server processes, 0 for none (default 2)")
    p.add_argument("--seed", type=int, default=0, help="the random seed (choices repeat; timing does not)")
    p.add_argument("--root", type=Path, help="where the data dirs go (default: a temporary folder, removed)")
    args = p.parse_args(argv)
    if args.quick:
        args.nodes, args.lab_hosts, args.duration = 12, 3, 150.0
    return args


def plan_of(args: argparse.Namespace):
    from meshd.testing.soak import ChaosPlan, ExpertPlan, Pace, SoakPlan, TrainingPlan

    training = TrainingPlan(members=args.members, steps=args.train_steps, inner_steps=args.inner_steps,
                            kill_at=args.member_kill_at, timeout=args.duration + 90) if args.members else None
    return SoakPlan(duration=args.duration, writers=args.writers, dht_workers=args.dht_workers,
                    fetchers=args.fetchers, converge_timeout=args.converge_timeout,
                    rss_bound_mib=args.rss_bound, seed=args.seed, pace=Pace(model_mib=args.model_mib),
                    training=training, experts=ExpertPlan(servers=args.expert_servers) if args.expert_servers else None,
                    chaos=ChaosPlan(kill_every=args.kill_every, down_time=args.down_time,
                                    max_down=args.max_down, cut_every=args.cut_every, cut_time=args.cut_time))


def soak(args: argparse.Namespace, root: Path) -> int:
    """Build the clusters (the lab only where namespaces can be made), run, print; 1 if a check failed."""
    import trio
    from natlab import NatLab, netns_unavailable_reason
    from rich.console import Console

    from meshd.testing.soak import SOAK_CONFIG, loopback_cluster, print_report, run_soak
    from soak_lab import lab_cluster

    console = Console(width=160)
    with contextlib.ExitStack() as stack:
        clusters = [loopback_cluster(root / "daemons", args.nodes, SOAK_CONFIG)]
        reason = netns_unavailable_reason() if args.lab_hosts else "--lab-hosts 0"
        if reason is None:
            lab = stack.enter_context(NatLab())
            clusters.append(lab_cluster(lab, root / "daemons", args.lab_hosts, SOAK_CONFIG))
        else:
            console.print(f"no NAT lab: {reason}")
        load0 = os.getloadavg()
        report = trio.run(run_soak, clusters, plan_of(args), root / "work")
        load1 = os.getloadavg()
    print_report(report, console)
    console.print(f"{os.cpu_count()} CPUs; load average (1 min) {load0[0]:.1f} before, {load1[0]:.1f} after")
    return 1 if report.failures else 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.chdir(REPO)  # the daemons run `python -m`, which puts the working directory first on sys.path
    started = time.monotonic()
    root = args.root or Path(tempfile.mkdtemp(prefix="meshd-soak-"))
    try:
        return soak(args, root)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
        print(f"soak finished in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
