"""Churn benchmark: DiLoCo members as separate processes, one SIGKILLed mid-run and one joining late.

    .venv/bin/python benchmarks/learning_churn.py [--quick] [--members 4] [--steps 3000] [--keep DIR]

Every member is ``examples/train_digits.py`` in a process of its own (its own
meshd node, real QUIC over 127.0.0.1), training the digits MLP with DiLoCo
(H = 50) and printing its state hash after every outer round.  Two runs in
the same invocation:

1. undisturbed: ``--members`` members from start to end;
2. churn: the same, but the last member is SIGKILLed once the group reaches
   round ``--kill-at``, and a new member process (a fresh node, another init)
   is started once it reaches round ``--join-at`` (it is up a few seconds,
   some rounds, later); the newcomer takes the group's state and round from a
   live member and contributes from then on.

For each run: whether every member that reported a round reported the same
hash for it (bit-identical θ and outer momentum), the members at the end, the
survivors' test accuracy beside the undisturbed run's, and round times (the
longest shows what a dead member costs the others: the exchange timeout).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path[:1] = [str(REPO)]  # the repo, not this folder (benchmarks/nat.py shadows nat)
sys.path.append(str(REPO / "benchmarks"))
from parts import log  # noqa: E402
MEMBER = REPO / "examples" / "train_digits.py"


@dataclass
class Member:
    """One member process and what it has reported."""

    index: int
    process: trio.Process
    address: str | None = None
    rounds: dict[int, dict] = field(default_factory=dict)  # round -> its report (hash, acc, ...)
    seen_at: dict[int, float] = field(default_factory=dict)  # round -> when it was reported
    done: dict | None = None
    killed: bool = False
    ready: trio.Event = field(default_factory=trio.Event)
    closed: trio.Event = field(default_factory=trio.Event)  # its output has ended


class Run:
    """Member processes of one run, and the group's progress as they report it."""

    def __init__(self, root: Path, args, nursery: trio.Nursery):
        self.root, self.args, self.nursery = root, args, nursery
        self.members: list[Member] = []
        self.progress = trio.Event()  # set (and renewed) at every report

    async def start(self, index: int, share: int, bootstrap: str | None) -> Member:
        """Start member ``index`` training on data share ``share`` and wait until its node listens."""
        cmd = [sys.executable, str(MEMBER), "--data-dir", str(self.root / f"m{index}"), "--json",
               "--member", str(share), "--members", str(self.args.members), "--steps", str(self.args.steps),
               "--wait-for", str(self.args.members if index < self.args.members else 2)]
        if bootstrap:
            cmd += ["--bootstrap", bootstrap]
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"m{index}.log", "wb") as log:  # the member's own log, -v: its rounds
            process = await trio.lowlevel.open_process([*cmd, "-v"], stdout=subprocess.PIPE, stderr=log)
        member = Member(index, process)
        self.members.append(member)
        self.nursery.start_soon(self._read, member)
        with trio.fail_after(60):
            await member.ready.wait()
        return member

    async def _read(self, member: Member) -> None:
        buffer = b""
        async for chunk in member.process.stdout:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                self._take(member, json.loads(line))
        member.closed.set()

    def _take(self, member: Member, line: dict) -> None:
        if "ready" in line:
            member.address = line["ready"]
            member.ready.set()
        elif "round" in line:
            member.rounds[line["round"]] = line
            member.seen_at[line["round"]] = time.perf_counter()
        elif "done" in line:
            member.done = line
        self.progress.set()
        self.progress = trio.Event()

    def top_round(self) -> int:
        return max((max(m.rounds, default=-1) for m in self.members), default=-1)

    async def until_round(self, round_: int) -> None:
        while self.top_round() < round_:
            await self.progress.wait()

    def kill(self, member: Member) -> None:
        member.killed = True
        os.kill(member.process.pid, signal.SIGKILL)

    async def finish(self) -> None:
        """Wait for every member not killed to end; RuntimeError if one ended without finishing."""
        for member in self.members:
            if not member.killed:
                await member.closed.wait()
                if member.done is None:
                    raise RuntimeError(f"member {member.index} ended without finishing: see "
                                       f"{self.root / f'm{member.index}.log'} (--keep DIR keeps it)")

    def stop_all(self) -> None:
        for member in self.members:
            if member.process.returncode is None:
                member.process.kill()

    def summary(self) -> dict:
        """Hash agreement per round, survivors' accuracy, round times."""
        rounds = sorted({r for m in self.members for r in m.rounds})
        disagree = [r for r in rounds if len({m.rounds[r]["hash"] for m in self.members if r in m.rounds}) > 1]
        for r in disagree:
            log(f"round {r}: " + ", ".join(f"m{m.index} {m.rounds[r]['hash'][:8]}" for m in self.members if r in m.rounds))
        first = next(m for m in self.members if not m.killed)
        times = sorted(first.seen_at.items())
        gaps = [b - a for (_, a), (_, b) in zip(times, times[1:])]
        survivors = [m for m in self.members if not m.killed]
        return {"rounds": len(rounds), "disagree": disagree, "members": len(survivors),
                "acc": statistics.mean(m.done["acc"] for m in survivors),
                "resyncs": sum(m.done["resyncs"] for m in survivors),
                "median_round": statistics.median(gaps) if gaps else 0.0, "longest_round": max(gaps, default=0.0),
                "contributors": sorted({m.rounds[r]["contributors"] for m in survivors for r in m.rounds}
                                       - {None})}  # None: a round whose state the member took instead


async def one_run(root: Path, args, churn: bool) -> dict:
    async with trio.open_nursery() as nursery:
        run = Run(root, args, nursery)
        try:
            first = await run.start(0, 0, None)
            for i in range(1, args.members):
                await run.start(i, i, first.address)
            with trio.fail_after(args.timeout):
                if churn:
                    await run.until_round(args.kill_at)
                    run.kill(run.members[-1])
                    await run.until_round(args.join_at)
                    await run.start(args.members, args.members - 1, first.address)
                await run.finish()
            return run.summary()
        finally:
            run.stop_all()
            nursery.cancel_scope.cancel()


async def main(args) -> None:
    console = Console(width=160)
    table = Table(title=f"DiLoCo under churn: {args.members} member processes, digits MLP, H=50, "
                        f"{args.steps} inner steps", title_justify="left")
    for col in ("run", "rounds", "hashes agree every round", "members at end", "survivors' test acc",
                "contributors per round", "resyncs", "median round s", "longest round s"):
        table.add_column(col)
    with tempfile.TemporaryDirectory(prefix="meshd-churn-") as tmp:
        tmp = args.keep or tmp
        for label, churn in (("undisturbed", False),
                             (f"SIGKILL at round {args.kill_at}, join at round {args.join_at}", True)):
            r = await one_run(Path(tmp) / ("churn" if churn else "calm"), args, churn)
            table.add_row(label, str(r["rounds"]), "yes" if not r["disagree"] else f"NO (rounds {r['disagree']})",
                          str(r["members"]), f"{r['acc']:.3f}", ",".join(map(str, r["contributors"])),
                          str(r["resyncs"]), f"{r['median_round']:.2f}", f"{r['longest_round']:.2f}")
    console.print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2000 steps, kill at round 3, join at round 6")
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--kill-at", type=int, default=5)
    parser.add_argument("--join-at", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    parser.add_argument("--keep", type=Path, help="put the members' data dirs and logs here, and keep them")
    parsed = parser.parse_args()
    if parsed.quick:
        parsed.steps, parsed.kill_at, parsed.join_at = 2000, 3, 6
    trio.run(main, parsed)
