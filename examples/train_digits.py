"""One member of a DiLoCo training run on scikit-learn's digits, as a training script writes it.

    python examples/train_digits.py --data-dir /tmp/m0 --bootstrap PEERID@127.0.0.1:4100 \\
        --member 0 --members 3 --steps 600 --wait-for 3

Opens an in-process meshd node (its own identity and storage under
``--data-dir``), joins group ``--group``, waits until ``--wait-for`` members
are live, and trains the digits MLP with AdamW inner steps and DiLoCo outer
steps every ``--inner-steps``.  After every outer round it prints the round,
the test accuracy, the contributors and the first bytes of the state hash
(every member prints the same hash for the same round), or with ``--json``
one JSON object per line for a harness to read.  A member started late takes
the group's current state and round before its first step.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
import trio

sys.path[:1] = [str(Path(__file__).resolve().parent.parent)]
import meshd  # noqa: E402
import meshd.learning as ml  # noqa: E402
from meshd.services.learning import LearningSection  # noqa: E402
from meshd.testing.digits import BATCH, accuracy, batches, digits, mlp, split_iid  # noqa: E402


def report(args, line: dict) -> None:
    if args.json:
        print(json.dumps(line), flush=True)
    elif "round" in line:
        print(f"member {args.member}: round {line['round']:3d}  test acc {line['acc']:.3f}  "
              f"contributors {line['contributors'] if line['contributors'] is not None else '- (state taken)'}  "
              f"hash {line['hash'][:12]}", flush=True)
    else:
        print(f"member {args.member}: {line}", flush=True)


async def train(args) -> None:
    config = meshd.Config()
    config.learning = LearningSection(heartbeat_interval=args.heartbeat, discover_interval=1.0)
    x, y, x_test, y_test = digits()
    xs, ys = split_iid(x, y, args.members)[args.member % args.members]
    model = mlp(args.member)  # each its own init: the group takes one before the first step
    inner_opt = torch.optim.AdamW(model.parameters(), 1e-3)  # before the node: see docs/learning.md
    async with meshd.open_node(args.data_dir, listen="127.0.0.1:0", bootstrap=args.bootstrap,
                               config=config) as node:
        report(args, {"ready": str(node.address)})
        opt = ml.DiLoCo(node, model, inner_opt=inner_opt, group=args.group,
                        inner_steps=args.inner_steps, compression=args.compression)
        with trio.fail_after(60):
            while len(opt.group.live()) < args.wait_for:
                await trio.sleep(0.1)
        step, seen, stop_after = 0, opt.group.hash_round, None
        while step < args.steps and (stop_after is None or seen < stop_after):
            bx, by = batches(xs, ys, args.member, step)
            torch.nn.functional.cross_entropy(model(bx), by).backward()
            await opt.step(samples=BATCH)
            step = opt.steps  # a late member starts at the group's step
            if opt.group.hash_round != seen:
                seen = opt.group.hash_round
                last = opt.reports[-1] if opt.reports else None
                own = last is not None and last.round == seen  # else the round's state was taken, not exchanged
                report(args, {"round": seen, "acc": accuracy(model, x_test, y_test), "hash": opt.group.hash.hex(),
                              "contributors": last.contributors if own else None,
                              "missing": last.missing_values if own else None})
                if stop_after is None and args.stop_file is not None and args.stop_file.exists():
                    stop_after = int(args.stop_file.read_text())
        await opt.settle()  # a last round that came out otherwise here: the group's state, not ours
        report(args, {"done": True, "acc": accuracy(model, x_test, y_test), "resyncs": opt.resyncs,
                      "bytes_out": sum(opt.group.bytes_out.values())})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--bootstrap", action="append", default=[], help="PEERID@HOST:PORT (repeatable)")
    parser.add_argument("--group", default="digits")
    parser.add_argument("--member", type=int, default=0, help="which share of the data this member trains on")
    parser.add_argument("--members", type=int, default=1, help="how many shares the data is cut into")
    parser.add_argument("--wait-for", type=int, default=1, help="live members to wait for before training")
    parser.add_argument("--steps", type=int, default=600, help="inner steps in all")
    parser.add_argument("--stop-file", type=Path,
                        help="once this file exists, end after the outer round it names (checked after each round)")
    parser.add_argument("--inner-steps", type=int, default=50, help="H: inner steps between outer steps")
    parser.add_argument("--compression", default="none", choices=["none", "fp16", "bf16", "int8", "int4"])
    parser.add_argument("--heartbeat", type=float, default=0.5, help="seconds between hellos")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the group's rounds to stderr")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if args.verbose:
        logging.getLogger("meshd.learning").setLevel(logging.INFO)
    trio.run(train, args)


if __name__ == "__main__":
    main()
