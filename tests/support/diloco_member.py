"""One DiLoCo member in a process of its own, for tests/daemon/test_learning_sigkill.py.

    python tests/support/diloco_member.py DATA_DIR PEERID@HOST:PORT SEED

Opens an in-process meshd node in DATA_DIR (its identity is kept there, so a
process started again on it is the same member), joins ``learning_members``'
group with :func:`learning_members.tiny_model` (initialised from SEED), waits
for 3 live members and trains until it is killed.  One JSON object a line on
stdout: ``{"ready": "PEERID@HOST:PORT"}`` once the node listens, then after
every outer round ``{"round", "hash", "contributors", "resyncs"}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import meshd  # noqa: E402
from learning_members import Progress, Trainer, diloco, fast_config, tiny_model  # noqa: E402


def say(line: dict) -> None:
    print(json.dumps(line), flush=True)


async def main(data_dir: str, bootstrap: str, seed: int) -> None:
    torch.set_num_threads(1)
    async with meshd.open_node(data_dir, listen="127.0.0.1:0", bootstrap=[bootstrap], config=fast_config()) as node:
        await node.connect(bootstrap)
        say({"ready": str(node.address)})
        model = tiny_model(seed)
        opt = diloco(node, model)
        trainer = Trainer(opt, model, Progress(), seed=seed, on_round=lambda r, digest, n: say(
            {"round": r, "hash": digest.hex(), "contributors": n, "resyncs": opt.resyncs}))
        await trainer.until_live(3, timeout=60)
        await trainer.run()


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]))
