"""Learning simulation benchmark: many members in one process, the real sans-IO round logic over an in-memory network.

    .venv/bin/python benchmarks/learning_sim.py [--quick] [--members 256] [--deaths 0.02]

No sockets: :mod:`learn.simnet` drives each member's group view, gossip
rounds and all-reduce in virtual time, over links whose one-way latency is
drawn once per pair (lognormal, median 50 ms; σ 0 for "fast" links, σ 1 for
"slow" ones, where about 5% of gossip round trips miss a 0.5 s timeout).
In the same run:

1. Gossip averaging, ``--members`` members (256), each pulling d = 4 random
   live partners a round, 1,000-value float32 vectors, churn 0, 10% and 20%
   of the members replaced each round, on fast and slow links: rounds until
   every member is within 1% of the members' mean, bytes pulled per member per
   round, pulls that came late or went to a member that had left.  Beside it:
   the prediction for d fresh random partners a round (spread ÷ √(d+1) a
   round) and exact central averaging through a server (one round).
2. DiLoCo's outer all-reduce (:class:`learn.allreduce.AllReduce`, every
   member its own) of a 65,536-value float32 vector (256 kB) among 64, 128
   and 256 members, over slow links (timeout 1 s) and 100 Mbit/s uplinks,
   with no deaths and with ``--deaths`` of each round's contributors dying at
   a random time in it: contributions left out, parts missing, members that
   finished with the whole vector and whether their bits are identical, and
   bytes sent per member beside the 2 (N-1)/N of the vector a butterfly
   all-reduce sends.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

_HERE = Path(__file__).resolve().parent
sys.path[:1] = [str(_HERE.parent)]  # the repo, not this folder (benchmarks/nat.py shadows nat)
from learn.simnet import predicted_rounds, simulate, simulate_allreduce, wire_bytes  # noqa: E402

D = 4
GOSSIP_DIM = 1000
REDUCE_DIM = 1 << 16
LINKS = {"fast": 0.0, "slow": 1.0}  # σ of the lognormal one-way latency, median 50 ms


def _table(title: str, columns: list[str]) -> Table:
    """A left-titled rich table with these columns."""
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    return table


def _percent(part: int, whole: int) -> str:
    """``part`` and its share of ``whole``."""
    return f"{part} ({100 * part / whole:.1f}%)" if whole else "0"


# --- gossip -------------------------------------------------------------------------------------------


def gossip_table(members: int, churns: list[float], links: list[str]) -> Table:
    """Gossip runs beside the random-partner prediction and a central average."""
    table = _table(f"Gossip averaging, {members} members, d={D} partners a round, {GOSSIP_DIM} float32 values, "
                   f"until every member is within 1% of the mean", [
                       "run", "links", "churn / round", "rounds to 1%", "kB / member / round",
                       "kB / member to 1%", "pulls late", "pulls to gone members", "wall s"])
    runs = []
    for link in links:
        for churn in churns:
            started = time.perf_counter()
            result = simulate(members, D, churn, seed=0, dim=GOSSIP_DIM, jitter=LINKS[link])
            runs.append((link, churn, result, time.perf_counter() - started))
    vector = wire_bytes(GOSSIP_DIM)
    table.add_row("central average (a server)", "-", "0%", "1", f"{2 * vector / 1e3:.1f}", f"{2 * vector / 1e3:.1f}",
                  "-", "-", "-")
    start = runs[0][2].start_spread
    predicted = predicted_rounds(start, D)
    table.add_row(f"prediction: spread ÷ √(d+1) a round, from {start:.1f}", "-", "0%", str(predicted),
                  f"{D * vector / 1e3:.1f}", f"{predicted * D * vector / 1e3:.0f}", "-", "-", "-")
    for link, churn, result, wall in runs:
        pulls = sum(h.pulls for h in result.history)
        rounds = str(result.rounds) if result.converged else f">{result.rounds}"
        per_round = result.bytes_per_member_per_round
        table.add_row("gossip", link, f"{churn:.0%}", rounds, f"{per_round / 1e3:.1f}",
                      f"{result.rounds * per_round / 1e3:.0f}", _percent(sum(h.late for h in result.history), pulls),
                      _percent(sum(h.gone for h in result.history), pulls), f"{wall:.1f}")
    return table


# --- the all-reduce -----------------------------------------------------------------------------------


def allreduce_table(runs: list[tuple[int, float, int, bool]]) -> Table:
    """One row per round of each (members, deaths, rounds, compact lists) run."""
    table = _table(f"DiLoCo outer all-reduce, {REDUCE_DIM} float32 values ({4 * REDUCE_DIM / 1e3:.0f} kB), slow links, "
                   f"timeout 1 s, 100 Mbit/s uplinks", [
                       "members", "lists", "deaths", "round", "contrib.", "died", "left out", "late msgs",
                       "parts missing (all / some)", "finished", "identical bits", "largest agreeing",
                       "payload kB / member", "÷ ideal", "wire kB / member", "÷ ideal", "wall s"])
    for members, deaths, rounds, compact in runs:
        started = time.perf_counter()
        result = simulate_allreduce(members, rounds, deaths, seed=0, dim=REDUCE_DIM, compact_lists=compact)
        wall = time.perf_counter() - started
        for h in result.history:
            identical = ("yes" if h.identical else "NO") if h.finished > 1 else "-"
            table.add_row(str(members), "compact" if compact else "keys", f"{deaths:.0%}", str(h.round),
                          str(h.contributors), str(h.died), str(h.left_out), str(h.late),
                          f"{h.missing_everywhere} / {h.missing_somewhere}", f"{h.finished} / {h.survivors}",
                          identical, str(h.agreeing), f"{h.payload_per_member / 1e3:.1f}",
                          f"{h.payload_per_member / h.ideal_per_member:.2f}", f"{h.wire_per_member / 1e3:.1f}",
                          f"{h.wire_per_member / h.ideal_per_member:.2f}", f"{wall:.1f}" if h.round == 0 else "")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="churn 10%% only, all-reduce of 64 and 128 members")
    parser.add_argument("--members", type=int, default=256, help="gossip members")
    parser.add_argument("--deaths", type=float, default=0.02, help="all-reduce contributors dying per round")
    args = parser.parse_args()
    torch.set_num_threads(1)  # many small tensors: threads cost more than they give
    console = Console(width=200)
    started = time.perf_counter()
    churns = [0.1] if args.quick else [0.0, 0.1, 0.2]
    console.print(gossip_table(args.members, churns, list(LINKS)))
    # one round without deaths (links are drawn once, so the next would repeat it), two with
    sizes = [(64, 1), (128, 1)] if args.quick else [(64, 2), (128, 2), (256, 1)]
    runs = [run for n, rounds in sizes for run in ((n, 0.0, 1, True), (n, args.deaths, rounds, True))]
    if not args.quick:
        runs.append((128, 0.0, 1, False))  # the lists as the shell sent them before
    console.print(allreduce_table(runs))
    console.print("lists: the contributors named in each part's head and the contributors used in each reduced "
                  "part's, compact (a digest of the list, a bitmap over "
                  "it: meshd's shell) or as lists of keys (the shell before).  Left out: (part, contributor) pairs reduced without that contributor.  Missing: parts "
                  "no survivor / some survivor holds at the deadline.  Largest agreeing: survivors holding the same "
                  "parts with the same bits.")
    console.print(f"[dim]wall {time.perf_counter() - started:.0f} s[/dim]")


if __name__ == "__main__":
    main()
