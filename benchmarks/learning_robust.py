"""Robust aggregation benchmark: DiLoCo with one Byzantine member among 8, beside the honest run.

    .venv/bin/python benchmarks/learning_robust.py [--quick] [--members 8] [--steps 600] [--scale 100]

Every member is a meshd node of its own (one process, real QUIC over
127.0.0.1, the service's default [learning] timings); the data is
scikit-learn's digits split IID, the model the 64-128-10 MLP, each member
takes ``--steps`` AdamW inner steps and the group syncs every H = 50 (the
setup of ``benchmarks/learning.py``'s DiLoCo part).  In the same run:

* the honest group with ``mean`` (the reference), and with ``trimmed_mean`` and
  ``centered_clip`` (what the robust rules cost when nobody attacks);
* the same group where the last member is Byzantine, with ``mean``,
  ``trimmed_mean`` and ``centered_clip``.

The Byzantine member is a real member: its own node in the group, signing
what it sends, training like the others; only the pseudo-gradient it
contributes is replaced by Gaussian noise whose norm is ``--scale`` times
that of its honest one.  That is :class:`NoisyDiLoCo`, a subclass defined
here that overrides ``DiLoCo._delta``, a private method: fine for a
benchmark, not an API.

Reported per run: the test accuracy of an honest member (every member holds
the same θ after the last outer step), its distance from the honest ``mean``
run, whether every member's state hash agreed at the end, resyncs, and the
``clipped`` counts the group keeps (``Group.clipped``: a reducer counts, for
its slice of each round, the contributors its rule trimmed or clipped),
summed over all reducers, for the bad member and for the honest ones.  Then
``meshctl learning status`` of an honest member of the Byzantine
``centered_clip`` run, run as a subprocess against that member's control
socket while the group is still up: what an operator sees.

Targets (issue 12): with 1 of 8 sending scaled noise, ``mean`` collapses and
``trimmed_mean`` / ``centered_clip`` stay within 2 points of the honest run;
a member whose contributions are repeatedly clipped is reported.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path

import torch
import trio
from rich.console import Console
from rich.table import Table

_HERE = Path(__file__).resolve().parent
sys.path[:1] = [str(_HERE.parent)]  # the repo, not this folder (benchmarks/nat.py shadows nat)
sys.path.append(str(_HERE))
import meshd.learning as ml  # noqa: E402
from learnkit import (GROUP, SERVICE_TIMINGS, accuracy, digits, mlp, open_members, split_iid,  # noqa: E402
                      train_diloco, wait_group)

H = 50


class NoisyDiLoCo(ml.DiLoCo):
    """A Byzantine member: trains as usual, but contributes Gaussian noise with
    ``scale`` times the norm of its honest pseudo-gradient."""

    def __init__(self, *args, scale: float, seed: int, **kw):
        super().__init__(*args, **kw)
        self.scale = scale
        self._gen = torch.Generator().manual_seed(seed)

    def _delta(self, p: int) -> torch.Tensor:
        honest = super()._delta(p)
        noise = torch.randn(honest.shape, generator=self._gen)
        return noise * (self.scale * honest.norm() / noise.norm())


async def _meshctl_status(data_dir: Path) -> str:
    """``meshctl learning status`` against the node at ``data_dir``, as an operator runs it."""
    env = {**os.environ, "COLUMNS": "150", "PYTHONPATH": str(_HERE.parent)}
    done = await trio.run_process([sys.executable, "-m", "cli.meshctl", "--data-dir", str(data_dir),
                                   "learning", "status", GROUP], capture_stdout=True, capture_stderr=True,
                                  check=False, cwd=str(_HERE.parent), env=env)
    return (done.stdout + done.stderr).decode(errors="replace")


async def run(root: Path, data, x_test, y_test, *, rule: str, bad: bool, steps: int, scale: float,
              status: bool = False) -> dict:
    members = len(data)
    async with AsyncExitStack() as stack:
        nodes = await open_members(stack, root, members, **SERVICE_TIMINGS)
        models = [mlp(0) for _ in range(members)]
        opts = []
        for m, (node, model) in enumerate(zip(nodes, models)):
            kw = dict(inner_opt=torch.optim.AdamW(model.parameters(), 1e-3), group=GROUP, inner_steps=H, rule=rule)
            if bad and m == members - 1:
                opts.append(NoisyDiLoCo(node, model, scale=scale, seed=m, **kw))
            else:
                opts.append(ml.DiLoCo(node, model, **kw))
        await wait_group(nodes)
        wall = await train_diloco(opts, models, data, steps)
        keys = [node.peer_id.key for node in nodes]
        clipped = [sum(opt.group.clipped[k] for opt in opts) for k in keys]  # over every reducer's slice
        out = {"acc": accuracy(models[0], x_test, y_test), "agree": len({opt.group.hash for opt in opts}) == 1,
               "rounds": max(opt.group.hash_round for opt in opts) + 1, "resyncs": sum(o.resyncs for o in opts),
               "clipped": clipped, "wall": wall,
               "peers": [str(node.peer_id) for node in nodes],
               "seen_by_0": [nodes[0].service("learning").groups[GROUP].clipped[k] for k in keys]}
        if status:
            out["status"] = await _meshctl_status(nodes[0].data_dir)
        return out


async def main(args) -> None:
    torch.set_num_threads(1)  # 8 members share this process: torch's threads would spin-wait for each other
    console = Console(width=170)
    x, y, x_test, y_test = digits()
    data = split_iid(x, y, args.members)
    runs = [("honest", "mean", False), ("honest", "trimmed_mean", False), ("honest", "centered_clip", False),
            ("1 Byzantine", "mean", True), ("1 Byzantine", "trimmed_mean", True),
            ("1 Byzantine", "centered_clip", True)]
    if args.quick:
        runs = [r for r in runs if r[2] or r[1] == "mean"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (who, rule, bad) in enumerate(runs):
            results[who, rule] = await run(Path(tmp) / f"r{i}", data, x_test, y_test, rule=rule, bad=bad,
                                           steps=args.steps, scale=args.scale,
                                           status=bad and rule == "centered_clip")
    honest = results["honest", "mean"]["acc"]
    bad_index = args.members - 1
    table = Table(title=f"DiLoCo, {args.members} members, {args.steps} AdamW inner steps, H={H}, digits MLP, IID; "
                        f"the Byzantine member (the last) sends Gaussian noise of {args.scale:g}x its "
                        f"pseudo-gradient's norm", title_justify="left")
    for col in ("members", "rule", "test acc (honest member)", "vs honest mean", "hashes agree", "resyncs",
                "outer rounds", "clipped: Byzantine member", "clipped: honest members (max, mean)", "wall s"):
        table.add_column(col)
    for (who, rule), r in results.items():
        reductions = r["rounds"] * args.members  # slices each contributor sent: one per reducer per round
        honest_counts = [c for i, c in enumerate(r["clipped"]) if i != bad_index or who == "honest"]
        table.add_row(who, rule, f"{r['acc']:.3f}", f"{100 * (r['acc'] - honest):+.1f} pts",
                      "yes" if r["agree"] else "NO", str(r["resyncs"]), str(r["rounds"]),
                      "-" if who == "honest" else f"{r['clipped'][bad_index]} of {reductions}",
                      f"{max(honest_counts)}, {sum(honest_counts) / len(honest_counts):.1f} of {reductions}",
                      f"{r['wall']:.0f}")
    console.print(table)

    per_member = Table(title="Clipped slices per member (Group.clipped summed over the reducers; "
                             "'of N' is rounds x reducers)", title_justify="left")
    per_member.add_column("member")
    shown = [(k, r) for k, r in results.items() if k[1] != "mean"]
    for (who, rule), r in shown:
        per_member.add_column(f"{who}, {rule}")
    for m in range(args.members):
        label = f"{m}{' (Byzantine in the attacked runs)' if m == bad_index else ''}"
        per_member.add_row(label, *(str(r["clipped"][m]) for _, r in shown))
    per_member.add_row("of", *(str(r["rounds"] * args.members) for _, r in shown))
    console.print(per_member)

    byz = results["1 Byzantine", "centered_clip"]
    console.print(f"[bold]meshctl learning status {GROUP}[/bold] on member 0 of the Byzantine centered_clip run "
                  f"(its own slice only: member {bad_index}, the Byzantine one, is "
                  f"{byz['peers'][bad_index][:16]}):")
    console.print(byz["status"], markup=False, highlight=False)

    targets = Table(title="Targets (issue 12)", title_justify="left")
    for col in ("target", "measured", "met"):
        targets.add_column(col)
    collapsed = results["1 Byzantine", "mean"]["acc"]
    rows = [(f"mean collapses with 1 Byzantine of {args.members} (over 20 points down)", f"{collapsed:.3f}",
             collapsed < honest - 0.2)]
    for rule in ("trimmed_mean", "centered_clip"):
        acc = results["1 Byzantine", rule]["acc"]
        rows.append((f"{rule} within 2 points of the honest run", f"{acc:.3f} vs {honest:.3f}", acc >= honest - 0.02))
    for rule in ("trimmed_mean", "centered_clip"):
        counts = results["1 Byzantine", rule]["clipped"]
        top = max(range(args.members), key=lambda m: counts[m])
        runner_up = max(c for m, c in enumerate(counts) if m != top)
        rows.append((f"{rule}: the Byzantine member is the one clipped most",
                     f"member {top} ({counts[top]} of {results['1 Byzantine', rule]['rounds'] * args.members}; "
                     f"next {runner_up})", top == bad_index))
    for label, value, met in rows:
        targets.add_row(label, value, "yes" if met else "NO")
    console.print(targets)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="150 steps (3 outer rounds), no honest robust runs")
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600, help="inner steps per member (H = 50)")
    parser.add_argument("--scale", type=float, default=100.0,
                        help="the noise's norm, in multiples of the Byzantine member's honest pseudo-gradient")
    args = parser.parse_args()
    if args.quick:
        args.steps = min(args.steps, 150)
    trio.run(main, args)
