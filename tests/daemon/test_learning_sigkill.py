"""A DiLoCo member process SIGKILLed mid-run and started again on its data dir catches up.

The member is ``tests/support/diloco_member.py``, a training script in a
process of its own (its own meshd node); the other two members are
in-process nodes here.  SIGKILL sends no goodbye: the others' QUIC
connections to it just go quiet, and the process that comes back has the same
PeerId at another port.  (tests/node/test_learning_restart.py stops an
in-process node instead, and checks Streaming DiLoCo.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import trio

from learning_members import Progress, Trainer, check_caught_up, diloco, fast_config, shared_full_rounds, tiny_model
from meshd.address import PeerAddr
from meshnodes import open_nodes

MEMBER = Path(__file__).resolve().parent.parent / "support" / "diloco_member.py"


class MemberProcess:
    """One ``diloco_member.py`` process and what it has said (each line sets ``progress``)."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.process: trio.Process | None = None
        self.address: PeerAddr | None = None
        self.ready = trio.Event()
        self.hashes: dict[int, bytes] = {}
        self.full: list[int] = []  # rounds whose exchange had all 3 members' pseudo-gradients
        self.resyncs = 0
        self.ended = trio.Event()  # its stdout closed: it has exited

    async def run(self, data_dir: Path, bootstrap: str, seed: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Start it, hand back once it runs, read its lines until it exits; SIGKILL it if cancelled first."""
        with open(data_dir.parent / f"{data_dir.name}.log", "ab") as log:
            self.process = await trio.lowlevel.open_process(
                [sys.executable, str(MEMBER), str(data_dir), bootstrap, str(seed)], stdout=subprocess.PIPE, stderr=log)
        task_status.started()
        try:
            buffer = b""
            async for chunk in self.process.stdout:
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    self._take(json.loads(line))
        finally:
            self.ended.set()
            self.kill()
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await self.process.wait()

    def _take(self, line: dict) -> None:
        if "ready" in line:
            self.address = PeerAddr.parse(line["ready"])
            self.ready.set()
        elif "round" in line:
            self.hashes[line["round"]] = bytes.fromhex(line["hash"])
            if line["contributors"] == 3:
                self.full.append(line["round"])
            self.resyncs = line["resyncs"]
        self.progress.changed()

    def kill(self) -> None:
        """SIGKILL: no goodbye to anyone."""
        if self.process.returncode is None:
            self.process.kill()


async def _train(trainer: Trainer) -> None:
    await trainer.until_live(3, timeout=60)
    await trainer.run()


async def test_a_sigkilled_member_process_restarted_on_its_data_dir_catches_up(tmp_path):
    """SIGKILL a member process mid-run, let the others go on, start the process again on the
    same data dir with another init: the same PeerId; it takes the group's current θ, momentum
    and round before its first step; its hash equals the others' for every round it reports;
    and from then on its pseudo-gradient is in the others' reductions again."""
    progress = Progress()
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 2, fast_config())
        models = [tiny_model(seed) for seed in range(2)]
        survivors = [Trainer(diloco(node, model), model, progress, seed=seed)
                     for seed, (node, model) in enumerate(zip(nodes, models))]
        async with trio.open_nursery() as nursery:
            member = MemberProcess(progress)
            await nursery.start(member.run, tmp_path / "m", str(nodes[0].address), 2)
            with trio.fail_after(60):  # it imports torch
                await member.ready.wait()
            key = member.address.peer_id.key
            for trainer in survivors:
                nursery.start_soon(_train, trainer)
            await progress.until(lambda: max(member.hashes, default=-1) >= 1
                                 and all(t.last_round() >= 1 for t in survivors), timeout=60)
            assert all(t.group.used[key] > 0 for t in survivors)  # it contributed before it was killed

            member.kill()
            with trio.fail_after(10):
                await member.ended.wait()
            stopped_at = max(t.last_round() for t in survivors)
            await progress.until(lambda: all(t.last_round() >= stopped_at + 2 for t in survivors), timeout=60)
            go, held = trio.Event(), max(t.last_round() for t in survivors) + 1
            for trainer in survivors:  # both end round `held`, then wait: no CPU taken from a starting process
                trainer.hold = (held, go)
            await progress.until(lambda: all(t.last_round() >= held for t in survivors), timeout=30)
            used_before = [t.group.used[key] for t in survivors]
            behind = min(t.group.round for t in survivors)

            back = MemberProcess(progress)
            await nursery.start(back.run, tmp_path / "m", str(nodes[1].address), 99)  # another init
            with trio.fail_after(60):
                await back.ready.wait()
            assert back.address.peer_id.key == key  # the same identity, from its data dir
            go.set()  # the group trains on while it comes back

            def caught_up() -> bool:  # two rounds with it in, as it and the others' reducers saw them
                return len(shared_full_rounds(back.hashes, back.full, survivors)) >= 2 \
                    and all(t.group.used[key] >= used + 2 for t, used in zip(survivors, used_before))

            await progress.until(caught_up, timeout=60)
            nursery.cancel_scope.cancel()

    check_caught_up(back.hashes, back.full, back.resyncs, survivors, behind)
