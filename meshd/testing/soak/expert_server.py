"""An expert server of the soak: a node of its own serving a tiny torch MLP until it is killed.

    python -m meshd.testing.soak.expert_server --data-dir DIR --bootstrap PEERID@HOST:PORT [--expert-id ID]

Opens an in-process meshd node (identity and storage under ``--data-dir``,
so a restart on the same dir is the same peer), connects to the bootstrap
daemon, serves :func:`expert_module` as expert ``--expert-id`` (announced in
the DHT) and prints ``{"ready": ADDRESS, "peer": PEERID}`` on stdout once
it serves; then it runs until it is killed.  Every server of one id serves
the same weights, so a caller can check any answer against its own copy.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
import trio

IN, HIDDEN, OUT = 8, 16, 4


def expert_module(seed: int = 0) -> torch.nn.Module:
    """The soak's expert: an 8-16-4 MLP, the same weights for the same ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return module.eval()


async def serve(args) -> None:
    import meshd

    config = meshd.Config()
    config.update(json.loads(args.config))
    async with meshd.open_node(args.data_dir, listen="127.0.0.1:0", bootstrap=[args.bootstrap],
                               config=config) as node:
        await node.connect(args.bootstrap)
        table, began = node.service("dht").node.table, trio.current_time()
        with trio.move_on_after(args.settle_timeout):  # know the mesh before announcing (docs/soak.md)
            while len(table) < args.min_contacts:
                await trio.sleep(0.1)
        # what meshd.experts.serve does (meshd.testing may not import meshd.experts: pyproject's layers)
        await node.service("experts").serve(args.expert_id, expert_module(args.seed), kind="module", domain="soak",
                                            model=None, max_batch=32, max_wait_ms=5.0)
        print(json.dumps({"ready": str(node.address), "peer": str(node.peer_id), "contacts": len(table),
                          "settled": round(trio.current_time() - began, 2)}), flush=True)
        await trio.sleep_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--bootstrap", required=True, help="PEERID@HOST:PORT")
    parser.add_argument("--expert-id", default="soak-mlp")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default="{}", help="config overrides, as JSON")
    parser.add_argument("--min-contacts", type=int, default=0,
                        help="serve once the DHT routing table holds this many contacts (or after --settle-timeout)")
    parser.add_argument("--settle-timeout", type=float, default=20.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    trio.run(serve, args)


if __name__ == "__main__":
    main()
