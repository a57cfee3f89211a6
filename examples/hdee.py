"""A heterogeneous domain expert ensemble (HDEE) on the mesh, as a script writes one.

    .venv/bin/python examples/hdee.py [--bootstrap PEERID@HOST:PORT] [--steps 300] [--chars 60000]

Trains (here, seeded, on one torch thread, in well under a minute) three
character-level language models (a small GRU over bytes,
``meshd.testing.experts_kit``) on three text domains any Debian machine has:
Python standard-library source, the licence texts in
``/usr/share/common-licenses`` and packages' Debian changelogs.  A seed
model learns the mix first; each domain's expert is branched from it and
trained further, the steps shared by how hard the seed model finds each
domain (heterogeneous experts).  Each expert is served by a meshd node of
its own (``mx.serve``, kind ``lm``); a fourth node mixes them with
``mx.HDEEEnsemble`` and prints bits per character on each domain's test
text and on man pages, which no expert saw:

* each expert alone;
* the posterior rule (each expert weighted by how well it predicted the text
  so far) with a uniform prior, and with the cached prior
  (``estimate_prior`` on held-out dev text);
* uniform averaging of the experts' probabilities (``rule="uniform"``).

Last it asks the ensemble for the next character after a line of code
(``next_token_logprobs``: the mixture, and which experts answered).
``--bootstrap`` joins the script's nodes to a mesh (``make demo``'s
daemons, say); without it they form a mesh of their own on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import torch
import trio

import meshd
import meshd.experts as mx
from meshd.testing import experts_kit as kit


def train(args) -> tuple[dict, dict, dict]:
    """The data of every domain, the experts (by domain) and the steps each got."""
    data = {d: kit.splits(d, args.chars) for d in (*kit.DOMAINS, kit.EVAL_DOMAIN)}
    seed = kit.CharLM(width=args.width, seed=0)
    kit.train_lm(seed, torch.cat([data[d]["train"] for d in kit.DOMAINS]), args.seed_steps, seq=64, batch=16,
                 lr=args.lr, seed=0)
    hardness = {d: kit.bpc(kit.token_logprobs(seed, data[d]["dev"][:args.eval])) for d in kit.DOMAINS}
    steps = {d: round(args.steps * h / sum(hardness.values())) for d, h in hardness.items()}
    experts = {}
    for i, d in enumerate(kit.DOMAINS):
        experts[d] = kit.branch(seed)
        kit.train_lm(experts[d], data[d]["train"], steps[d], seq=64, batch=16, lr=args.lr, seed=1 + i)
        experts[d].eval()
    return data, experts, steps


async def main(args) -> None:
    started = time.perf_counter()
    torch.set_num_threads(1)
    data, experts, steps = train(args)
    print(f"trained 3 experts of {kit.param_count(experts['code']):,} parameters in "
          f"{time.perf_counter() - started:.0f} s; steps by difficulty: {steps}")
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(meshd.open_node(
            Path(args.data_dir, "caller"), listen="127.0.0.1:0", bootstrap=[args.bootstrap] if args.bootstrap else []))
        if args.bootstrap:
            await first.connect(args.bootstrap)
        for d, expert in experts.items():  # each expert on a node of its own
            node = await stack.enter_async_context(meshd.open_node(
                Path(args.data_dir, d), listen="127.0.0.1:0", bootstrap=[str(first.address)]))
            await node.connect(first.address)
            await mx.serve(node, expert, expert_id=f"lm-{d}", kind="lm", domain=d)
        ids = [f"lm-{d}" for d in kit.DOMAINS]
        cached = mx.HDEEEnsemble(first, ids)
        prior = await cached.estimate_prior([data[d]["dev"][:args.eval] for d in kit.DOMAINS])
        print("cached prior (mean posterior on dev text): "
              + ", ".join(f"{e} {p:.2f}" for e, p in prior.items()))
        rows = {f"expert {d} alone": mx.HDEEEnsemble(first, [f"lm-{d}"]) for d in kit.DOMAINS}
        rows |= {"posterior, uniform prior": mx.HDEEEnsemble(first, ids, prior="uniform"),
                 "posterior, cached prior": cached,
                 "uniform averaging": mx.HDEEEnsemble(first, ids, rule="uniform")}
        texts = [*kit.DOMAINS, kit.EVAL_DOMAIN]
        print(f"\nbits per character on {args.eval:,} bytes of each test text (lower is better):")
        print(f"{'':26}" + "".join(f"{t:>12}" for t in texts[:-1]) + f"{texts[-1] + ' (held out)':>22}")
        for what, ens in rows.items():
            bpcs = []
            for t in texts:
                scored = await ens.score(data[t]["test"][:args.eval])
                bpcs.append(kit.bpc(scored.logp))
            print(f"{what:26}" + "".join(f"{b:12.3f}" for b in bpcs[:-1]) + f"{bpcs[-1]:22.3f}")
        context = kit.encode("import os\nimport sys\n\n\ndef main(args):\n    for name in ")
        nxt = await rows["posterior, uniform prior"].next_token_logprobs(context)
        top = torch.topk(nxt.logp.exp(), 3)
        print(f"\nafter {bytes(context[-20:].tolist()).decode()!r}: next byte "
              + ", ".join(f"{chr(i)!r} {p:.2f}" for p, i in zip(top.values.tolist(), top.indices.tolist()))
              + f"; answered {nxt.answered}, weights "
              + ", ".join(f"{e} {w:.3f}" for e, w in nxt.weights.items()))
    print(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", help="a node of the mesh to join, PEERID@HOST:PORT (default: none)")
    parser.add_argument("--data-dir", help="where the script's nodes keep their state (default: a temporary dir)")
    parser.add_argument("--chars", type=int, default=60_000, help="characters read per text domain")
    parser.add_argument("--width", type=int, default=64, help="the GRU's width")
    parser.add_argument("--seed-steps", type=int, default=100, help="steps of the seed model on the mix")
    parser.add_argument("--steps", type=int, default=300, help="the experts' steps together, shared by difficulty")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--eval", type=int, default=2000, help="bytes of each test (and dev) text scored")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshd-hdee-") as tmp:
        args.data_dir = args.data_dir or tmp
        trio.run(main, args)
