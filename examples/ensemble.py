"""A decentralized diffusion-model ensemble on the mesh, as a script writes one.

    .venv/bin/python examples/ensemble.py --bootstrap PEERID@HOST:PORT [--data-dir DIR] [--steps 300]

Trains (here, seeded, in a few seconds) 4 flow-matching experts, each on one
k-means cluster of a 2-D mixture of 16 Gaussians, and a router; serves each
expert and the router from a meshd node of its own (``mx.serve``), all
bootstrapped from ``--bootstrap``; then a fifth node samples with
``mx.DDMEnsemble`` in three modes and prints how close the samples come to
held-out data (MMD², lower is better), which experts answered and how many
rows each evaluated.  Last, the node serving expert c1 stops halfway through
a sampling run: the run completes without it and says so.  ``make demo``
runs it against its daemons.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import trio

import meshd
import meshd.experts as mx
from experts import ddm
from meshd.testing import experts_kit as kit
from meshd.testing.nodes import node_until_cancelled


async def main(args) -> None:
    torch.set_num_threads(1)
    models = kit.train_ddm(args.steps, args.samples)
    print(f"trained 4 experts of {models['params'][0]:,} parameters and a router ({args.steps} steps each)")
    async with trio.open_nursery() as nursery:
        nodes = []
        for i in range(6):
            node, scope = await nursery.start(node_until_cancelled, Path(args.data_dir, f"node{i}"), args.bootstrap)
            nodes.append((node, scope))
        for k, expert in enumerate(models["experts"]):
            await mx.serve(nodes[k][0], expert, expert_id=f"c{k}", kind="flow", domain=f"cluster {k}")
        await mx.serve(nodes[4][0], models["router"], expert_id="router", kind="router")
        caller = nodes[5][0]
        ids = [f"c{k}" for k in range(4)]
        print(f"floor (two held-out draws): MMD² {models['floor']:.4f}")
        for mode, k in (("full", 2), ("topk", 2), ("uniform", 2)):
            ens = mx.DDMEnsemble(caller, ids, "router" if mode != "uniform" else None, mode=mode, top_k=k)
            out = await ens.sample(args.samples, 2, steps=args.sample_steps, seed=1)
            print(f"  {mode:8} MMD² {kit.mmd(out.x, models['held']):.4f}  rows evaluated "
                  f"{dict(sorted(out.rows.items()))}")
        ens = mx.DDMEnsemble(caller, ids, "router", mode="topk", top_k=2)
        sampled = mx.Sampled(torch.zeros(0), {}, {})
        x = torch.randn(args.samples, 2, generator=torch.Generator().manual_seed(1))
        for i, t in enumerate(ddm.euler_times(args.sample_steps)):
            if i == args.sample_steps // 2:
                nodes[1][1].cancel()  # the node serving c1 stops
            x = ddm.euler_step(x, await ens.velocity(x, t, sampled), 1 / args.sample_steps)
        print(f"  topk, c1's node stopped halfway: completed, MMD² {kit.mmd(x, models['held']):.4f}, "
              f"dropped {sorted(sampled.dropped)}")
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", required=True, help="a node of the mesh, PEERID@HOST:PORT")
    parser.add_argument("--data-dir", help="where the script's nodes keep their state (default: a temporary dir)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per expert and the router")
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--sample-steps", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshd-ensemble-") as tmp:
        args.data_dir = args.data_dir or tmp
        trio.run(main, args)
