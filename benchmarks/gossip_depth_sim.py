"""Gossip on digits, simulated centrally: which model shows the "vanishing variance" stall?

    nice -n 5 .venv/bin/python benchmarks/gossip_depth_sim.py [--hidden 128,128,128] [--act relu]
        [--init default] [--lr 0.1] [--momentum 0.5] [--batch 8] [--epochs 2] [--seeds 0,1,2]

The setup of ``benchmarks/learning.py``'s gossip part, in one process and with
no nodes: 16 members on the IID digits split (``split_iid``), each with its own
random init; each round every member takes ``--epochs`` local epochs of SGD
(momentum reset every round, the same shuffles as ``learnkit.local_epochs``),
then merges, with the real ``learn.merge.merge_state``, its own state with the
states (all taken after the round's local epochs, before any merge) of
``--partners`` (4) partners drawn at random from the other 15; 30 rounds.
Beside it, FedAvg computed centrally (common init, the same local epochs, the
plain mean of all 16 after every round).  Printed: the members' mean test
accuracy by round for FedAvg, ``variance_corrected`` and ``mean``, per seed
(the seed moves the inits, FedAvg's init and the partner draws) and the mean
over seeds, and whether issue 12's targets hold.

The 16 members train at once as one batched model (``torch.bmm`` over stacked
weights, each member's loss its own batch's mean, summed), which gives each
member the gradients it would get alone; momentum SGD is elementwise, so the
stacked optimizer is 16 independent ones.  ``--check`` compares this with
training the members one by one through ``learnkit.local_epochs`` (and that
``--hidden 128,128,128 --act tanh`` builds ``learnkit.gossip_deep_mlp``, the
model ``benchmarks/learning.py --gossip-model deep`` runs).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
sys.path[:1] = [str(_HERE.parent)]  # the repo, not this folder (benchmarks/nat.py shadows nat)
sys.path.append(str(_HERE))
from learn.merge import merge_state  # noqa: E402
from learnkit import digits, gossip_deep_mlp, local_epochs, split_iid  # noqa: E402

ACTS = {"relu": torch.relu, "tanh": torch.tanh, "gelu": torch.nn.functional.gelu,
        "sigmoid": torch.sigmoid, "elu": torch.nn.functional.elu}
SHOWN = (1, 2, 3, 5, 10, 15, 20, 25, 30)


def make_mlp(hidden: list[int], act: str, init: str, seed: int) -> torch.nn.Sequential:
    """A 64-hidden...-10 MLP; ``init``: ``default`` (torch's Linear), ``kaiming`` (He normal, zero
    biases), ``kaiming_uniform`` (He uniform, torch's default biases), ``xavier`` (Glorot normal,
    zero biases)."""
    torch.manual_seed(seed)
    sizes = [64, *hidden, 10]
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        lin = torch.nn.Linear(a, b)
        if init == "kaiming":
            torch.nn.init.kaiming_normal_(lin.weight, nonlinearity="relu")
            torch.nn.init.zeros_(lin.bias)
        elif init == "kaiming_uniform":
            torch.nn.init.kaiming_uniform_(lin.weight, nonlinearity="relu")
        elif init == "xavier":
            torch.nn.init.xavier_normal_(lin.weight)
            torch.nn.init.zeros_(lin.bias)
        elif init != "default":
            raise ValueError(f"unknown init {init!r}")
        layers.append(lin)
        if i < len(sizes) - 2:
            layers.append({"relu": torch.nn.ReLU(), "tanh": torch.nn.Tanh(), "gelu": torch.nn.GELU(),
                           "sigmoid": torch.nn.Sigmoid(), "elu": torch.nn.ELU()}[act])
    return torch.nn.Sequential(*layers)


class Stack:
    """``len(models)`` MLPs of one shape as stacked weights [M, out, in] and biases [M, out]."""

    def __init__(self, models: list[torch.nn.Sequential], act: str):
        self.names = [n for n, _ in models[0].named_parameters()]
        self.params = [torch.stack([dict(m.named_parameters())[n].detach() for m in models]).clone().requires_grad_()
                       for n in self.names]
        self.act = ACTS[act]
        self.m = len(models)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [M, B, 64]
        h = x
        pairs = list(zip(self.params[0::2], self.params[1::2]))
        for i, (w, b) in enumerate(pairs):
            h = torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2))
            if i < len(pairs) - 1:
                h = self.act(h)
        return h

    def state(self, i: int) -> dict[str, torch.Tensor]:
        return {n: p[i].detach().clone() for n, p in zip(self.names, self.params)}

    def load(self, states: list[dict[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for n, p in zip(self.names, self.params):
                p.copy_(torch.stack([s[n] for s in states]))

    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> list[float]:
        with torch.no_grad():
            out = self.forward(x.expand(self.m, *x.shape))
            return (out.argmax(-1) == y).float().mean(1).tolist()


def train_round(stack: Stack, data, args, r: int, seeds: list[int] | None = None) -> None:
    """Every member's local epochs at once; member m shuffles with seed r·100 + m as
    ``learnkit.local_epochs`` does (``seeds`` overrides per member)."""
    opt = torch.optim.SGD(stack.params, args.lr, momentum=args.momentum)
    m_count = stack.m
    gens = [torch.Generator().manual_seed(seeds[m] if seeds else r * 100 + m) for m in range(m_count)]
    for _ in range(args.epochs):
        orders = [torch.randperm(len(x), generator=g) for (x, _), g in zip(data, gens)]
        steps = max(math.ceil(len(x) / args.batch) for x, _ in data)
        for s in range(steps):
            xb = torch.zeros(m_count, args.batch, 64)
            yb = torch.zeros(m_count, args.batch, dtype=torch.long)
            mask = torch.zeros(m_count, args.batch)
            for m, ((x, y), order) in enumerate(zip(data, orders)):
                idx = order[s * args.batch:(s + 1) * args.batch]
                xb[m, :len(idx)], yb[m, :len(idx)], mask[m, :len(idx)] = x[idx], y[idx], 1
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(stack.forward(xb).reshape(-1, 10), yb.reshape(-1),
                                                     reduction="none").reshape(m_count, -1)
            ((loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum().backward()
            opt.step()


def gossip(make, data, x_test, y_test, rule: str, args, seed: int) -> list[float]:
    members = len(data)
    stack = Stack([make(1000 * seed + 100 + m) for m in range(members)], args.act)
    rng = random.Random(seed)
    acc = []
    for r in range(args.rounds):
        train_round(stack, data, args, r)
        states = [stack.state(m) for m in range(members)]
        merged = []
        for m in range(members):
            partners = rng.sample([p for p in range(members) if p != m], args.partners)
            merged.append(merge_state(states[m], [states[p] for p in partners], rule))
        stack.load(merged)
        acc.append(sum(stack.accuracy(x_test, y_test)) / members)
    return acc


def fedavg(make, data, x_test, y_test, args, seed: int) -> list[float]:
    members = len(data)
    common = make(1000 * seed)
    state = {n: p.detach().clone() for n, p in common.named_parameters()}
    stack = Stack([common] * members, args.act)
    acc = []
    for r in range(args.rounds):
        stack.load([state] * members)
        train_round(stack, data, args, r)
        state = {n: p.detach().mean(0) for n, p in zip(stack.names, stack.params)}
        stack.load([state] * members)
        acc.append(stack.accuracy(x_test, y_test)[0])
    return acc


def check(make, data, args) -> None:
    """The batched members against ``learnkit.local_epochs``, one round from their inits."""
    models = [make(100 + m) for m in range(len(data))]
    stack = Stack(models, args.act)
    train_round(stack, data, args, 0)
    worst = 0.0
    for m, (x, y) in enumerate(data):
        opt = torch.optim.SGD(models[m].parameters(), args.lr, momentum=args.momentum)
        local_epochs(models[m], opt, x, y, args.epochs, m, batch=args.batch)
        for n, p in models[m].named_parameters():
            worst = max(worst, float((p.detach() - stack.params[stack.names.index(n)][m].detach()).abs().max()))
    print(f"batched vs one-by-one: largest parameter difference after a round {worst:.2e}")
    ours, theirs = make_mlp([128] * 3, "tanh", "default", 7), gossip_deep_mlp(7)
    same = str(ours) == str(theirs) and all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(),
                                                                             theirs.state_dict().values()))
    print(f"--hidden 128,128,128 --act tanh is learnkit.gossip_deep_mlp: {'yes' if same else 'NO'}")


def targets(fa: list[float], vc: list[float], mean: list[float]) -> dict[str, bool]:
    return {"vc>=0.90@10": vc[9] >= 0.90, "vc>=0.95@30": vc[-1] >= 0.95,
            "vc within 1.5 of FedAvg": vc[-1] >= fa[-1] - 0.015, "mean<0.40@10": mean[9] < 0.40}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="128", help="hidden widths, comma-separated")
    parser.add_argument("--act", default="relu", choices=sorted(ACTS))
    parser.add_argument("--init", default="default", choices=["default", "kaiming", "kaiming_uniform", "xavier"])
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--partners", type=int, default=4)
    parser.add_argument("--members", type=int, default=16)
    parser.add_argument("--seeds", default="0", help="comma-separated")
    parser.add_argument("--rules", default="variance_corrected,mean")
    parser.add_argument("--check", action="store_true", help="check the batched training, then exit")
    parser.add_argument("--brief", action="store_true", help="one line per seed and the mean")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hidden = [int(h) for h in args.hidden.split(",") if h]

    def make(seed: int) -> torch.nn.Sequential:
        return make_mlp(hidden, args.act, args.init, seed)

    x, y, x_test, y_test = digits()
    data = split_iid(x, y, args.members)
    if args.check:
        check(make, data, args)
        return
    label = (f"64-{'-'.join(map(str, hidden))}-10 {args.act} init={args.init} lr={args.lr} "
             f"mom={args.momentum} batch={args.batch} epochs={args.epochs}")
    print(label)
    rules = args.rules.split(",")
    runs: dict[str, list[list[float]]] = {"FedAvg": [], **{r: [] for r in rules}}
    started = time.perf_counter()
    seeds = [int(s) for s in args.seeds.split(",")]
    shown = [r for r in SHOWN if r <= args.rounds]
    for seed in seeds:
        runs["FedAvg"].append(fedavg(make, data, x_test, y_test, args, seed))
        for rule in rules:
            runs[rule].append(gossip(make, data, x_test, y_test, rule, args, seed))
        if not args.brief:
            for name, curves in runs.items():
                print(f"  seed {seed} {name:20s} " + " ".join(f"{curves[-1][r - 1]:.3f}" for r in shown))
    print(f"  rounds{'':24s}" + " ".join(f"r{r:<4d}" for r in shown))
    for name, curves in runs.items():
        avg = [sum(c[i] for c in curves) / len(curves) for i in range(args.rounds)]
        print(f"  mean of {len(seeds)} {name:20s} " + " ".join(f"{avg[r - 1]:.3f}" for r in shown))
    if "variance_corrected" in runs and "mean" in runs:
        for i, seed in enumerate(seeds):
            t = targets(runs["FedAvg"][i], runs["variance_corrected"][i], runs["mean"][i])
            print(f"  seed {seed}: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in t.items()))
    print(f"  ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
