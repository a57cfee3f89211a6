"""A training script drives DiLoCo through a running daemon, over its control socket.

The daemon is a real ``meshd`` process; the script is this test (a client of
its control socket, ``meshd.connect``), training its own model; two in-process
nodes are members of the same group.  The daemon is the script's member: its
session runs the in-process DiLoCo over a shadow of the script's model, so
every member must end every outer round with the same hash, and the script's
model must then hold θ bit for bit.  A script that closes its session, or
whose connection drops (as when it dies), takes the daemon out of the group.
The shadow is shared memory (a file both processes map): no tensor crosses
the control socket, and the file is gone once both mapped it, whatever
happens to the session, and a dead daemon's leftovers once it starts again.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import torch
import trio

import meshd
import meshd.learning as ml
from learn.compress import encode
from learn.wire import header
from learning_members import GROUP, Progress, Trainer, diloco, fast_config, tiny_model
from meshd.rpc import InvalidArgument
from meshd.services.learning import shadows
from test_daemons import daemons  # noqa: F401  (the fixture)

FAST = {"learning": {"heartbeat_interval": 0.2, "discover_interval": 0.5, "round_timeout_min": 2.0}}
ROUNDS = 3  # outer rounds the script trains (0 .. ROUNDS - 1)


class Script:
    """The training script: its model, a RemoteDiLoCo, and what it held after each outer round."""

    def __init__(self, client, seed: int, progress: Progress):
        self.model = tiny_model(seed)
        self.opt = diloco(client, self.model)  # as the in-process members, a client where the node goes
        self.progress = progress
        self.hashes: dict[int, bytes] = {}
        self.params: dict[int, dict[str, torch.Tensor]] = {}  # round -> the model's parameters after it
        self._gen = torch.Generator().manual_seed(seed)

    async def train(self, rounds: int) -> None:
        opt = self.opt
        while opt.hash_round < rounds - 1:
            x = torch.randn(16, 16, generator=self._gen)
            self.model(x).pow(2).mean().backward()
            seen = opt.hash_round
            await opt.step(samples=16)
            if opt.hash_round != seen:
                self.hashes[opt.hash_round] = opt.hash
                self.params[opt.hash_round] = {n: p.detach().clone() for n, p in self.model.named_parameters()}
                self.progress.changed()


async def _until_gone(trainers: list[Trainer], key: bytes, timeout: float = 10.0) -> None:
    """Until no trainer counts ``key`` live (each hello it hears from the others re-checks)."""
    with trio.fail_after(timeout):
        for trainer in trainers:
            while key in trainer.group.live():
                await trainer.group._heard.wait()


async def _poll(condition, timeout: float = 10.0) -> None:
    """Until ``await condition()`` holds: what only the daemon (another process) knows, asked again and again."""
    with trio.fail_after(timeout):
        while not await condition():
            await trio.sleep(0.05)


def _files(data_dir: Path) -> list[Path]:
    """The shadow files there are for the daemon of ``data_dir``, in both places one may be."""
    return [f for d in shadows.directories(data_dir) if d.is_dir() for f in d.iterdir()]


def _leave_leftovers(data_dir: Path) -> list[Path]:
    """Shadow files as a daemon killed in a session's handshake leaves them."""
    data_dir.mkdir(mode=0o700)
    left = []
    for directory in shadows.directories(data_dir):
        directory.mkdir(mode=0o700)
        left.append(directory / f"dead{shadows.SUFFIX}")
        left[-1].write_bytes(b"\0" * 8192)
    return left


async def _everyone_live(script: Script, trainers: list[Trainer]) -> None:
    """Until all three members hear each other: as a script waits for its group before training."""
    for trainer in trainers:
        await trainer.until_live(3)

    async def three() -> bool:
        return await script.opt.live() == 3

    await _poll(three)


async def test_a_script_trains_through_a_daemon_in_step_with_in_process_members(daemons, tmp_path):  # noqa: F811
    started = time.perf_counter()
    leftovers = _leave_leftovers(tmp_path / "d")
    daemon = daemons("d", config=FAST)
    assert not any(f.exists() for f in leftovers)  # removed as the learning service started
    key = daemon.address.peer_id.key
    progress = Progress()
    async with AsyncExitStack() as stack:
        trainers, thetas, nodes = [], [], []
        for i in range(2):
            node = await stack.enter_async_context(meshd.open_node(
                tmp_path / f"n{i}", listen="127.0.0.1:0", bootstrap=[str(daemon.address)], config=fast_config()))
            await node.connect(daemon.address)
            nodes.append(node)
            model, theta = tiny_model(i), {}
            opt = diloco(node, model)
            thetas.append(theta)
            trainers.append(Trainer(opt, model, progress, seed=i, on_round=lambda r, digest, n, opt=opt, theta=theta:
                                    theta.__setitem__(r, {k: t.clone() for k, t in opt.theta.items()})))
        client = await stack.enter_async_context(meshd.connect(daemon.data_dir))
        script = Script(client, 7, progress)
        assert isinstance(script.opt, ml.RemoteDiLoCo)
        await script.opt.join()  # the daemon's member joins and greets; the state is taken at the first step
        [row] = await client.learning_groups()
        assert row["group"] == GROUP and row["client"]["algorithm"] == "diloco" and row["client"]["tensors"] == 4
        assert script.opt.memory == row["client"]["memory"] == "shared", script.opt.memory_why
        assert _files(daemon.data_dir) == []  # both mapped it: removed
        model = tiny_model(8)
        other = ml.DiLoCo(client, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.1), group=GROUP)
        with pytest.raises(InvalidArgument, match="already in group 'run42'"):
            await other.join()
        await _everyone_live(script, trainers)
        status = await trio.to_thread.run_sync(daemon.meshctl, "learning", "status", GROUP)  # as any member
        assert status["client"]["algorithm"] == "diloco" and sum(m["me"] for m in status["members"]) == 1
        assert {m["peer"] for m in status["members"]} >= {daemon.peer_id, *(str(node.peer_id) for node in nodes)}
        shown = await trio.to_thread.run_sync(daemon.meshctl_raw, "learning", "ls")
        assert "a client, 0 syncs, shared memory" in shown.stdout, shown.stdout

        async with trio.open_nursery() as nursery:
            paused, go = trio.Event(), trio.Event()
            for trainer in trainers:
                trainer.hold = (ROUNDS - 1, paused)  # after the script's last round, wait
                nursery.start_soon(trainer.run)
            await script.train(ROUNDS)
            await progress.until(lambda: all(t.last_round() >= ROUNDS - 1 for t in trainers), timeout=30)
            for r in range(ROUNDS):
                assert {t.hashes[r] for t in trainers} == {script.hashes[r]}, f"round {r}: hashes differ"
                for name, param in script.params[r].items():
                    assert torch.equal(param, thetas[0][r][name]), f"round {r}: the script's {name} is not θ"
            assert [r.round for r in script.opt.reports] == list(range(ROUNDS)) and script.opt.round == ROUNDS
            assert sum(t.group.used[key] for t in trainers) > 0  # the script's pseudo-gradient was in reductions
            assert script.opt.resyncs == 0
            [row] = await client.learning_groups()
            client_row = row["client"]
            assert client_row["syncs"] >= ROUNDS and (client_row["bytes_in"], client_row["bytes_out"]) == (0, 0)

            await script.opt.aclose()  # the daemon leaves before it answers; the others notice in 3 heartbeats
            assert await client.learning_groups() == []
            with pytest.raises(ml.SessionClosed):
                await script.opt.step()
            await _until_gone(trainers, key)
            for trainer in trainers:
                trainer.hold = (ROUNDS, go)
            paused.set()
            await progress.until(lambda: all(t.last_round() >= ROUNDS for t in trainers), timeout=30)
            assert all(t.opt.reports[-1].contributors == 2 for t in trainers)

            # a script that dies: its connection drops with no goodbye, and the daemon leaves
            async with meshd.connect(daemon.data_dir) as doomed:
                late = Script(doomed, 9, progress)
                await late.opt.start()  # joins, and takes the group's state and round
                assert late.opt.round == ROUNDS + 1 and late.opt.resyncs == 0 and late.opt.memory == "shared"
                for name, param in late.model.named_parameters():
                    assert torch.equal(param.detach(), thetas[0][ROUNDS][name]), name
                for trainer in trainers:
                    await trainer.until_live(3)
                await doomed.aclose()  # the connection closes under the session, as when a process dies

            async def left() -> bool:
                return await client.learning_groups() == []

            await _poll(left)
            assert _files(daemon.data_dir) == []
            await _until_gone(trainers, key)
            go.set()
            nursery.cancel_scope.cancel()
    assert time.perf_counter() - started < 60


async def test_a_session_refuses_what_its_script_did_not_declare(daemons):  # noqa: F811
    daemon = daemons("d", config=FAST)
    async with meshd.connect(daemon.data_dir) as client:
        base = {"algorithm": "diloco", "group": "checks", "inner_steps": 2}
        cases = [
            ({**base, "algorithm": "adam"}, "algorithm must be one of diloco, gossip"),
            ({**base, "tensors": [["w", "float32", [1 << 20, 1 << 20]]]}, "more than 8589934592 bytes"),
            ({**base, "tensors": [["w", "int64", [2]]]}, "dtype 'int64' is not one of float32"),
            ({**base, "tensors": [["w", "float32", [2]]], "rule": "median"}, "aggregation rule must be"),
            ({**base, "tensors": [["w", "float32", [2]]], "fragments": 2},
             r"fragments must be 1 to 1 \(the model's layers\)"),
            ({**base, "tensors": [["a.w", "float32", [2]], ["b.w", "float32", [2]]], "fragments": 2, "overlap": 2},
             r"overlap must be 1 to H/P \(1\)"),
            ({**base, "tensors": [["w", "float32", [2]]], "outer_momentum": 1.5}, "outer_momentum must be from 0"),
        ]
        for arg, words in cases:
            channel, stream = await client.open_channel("learning.session", arg)
            with pytest.raises(InvalidArgument, match=words):
                await channel.receive()
            stream.abort()

        arg = {**base, "tensors": [["w", "float32", [2]], ["b", "float32", [1]]]}
        for sent, words in [(("w", torch.zeros(3)), "w: expected float32 of shape [2], not 'float32' of shape [3]"),
                            (("v", torch.zeros(2)), "tensor 'v' is not one of the declared tensors"),
                            (("w", torch.zeros(2, dtype=torch.float64)), "w: expected float32")]:
            channel, stream = await client.open_channel("learning.session", arg)
            name, tensor = sent
            await channel.send(header(name, encode(tensor, "none")))
            with pytest.raises(InvalidArgument, match=words.replace("[", r"\[").replace("]", r"\]")):
                await channel.receive()
            stream.abort()
        assert await client.learning_groups() == []  # nothing joined


async def test_a_script_gossips_through_a_daemon(daemons, tmp_path):  # noqa: F811
    """The daemon offers the script's state_dict (BatchNorm buffers and all), pulls a partner's,
    and merges them as an in-process member would: the script gets exactly that merge."""
    from learn.merge import merge_state

    daemon = daemons("d", config=FAST)

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))

    async with meshd.open_node(tmp_path / "n", listen="127.0.0.1:0", bootstrap=[str(daemon.address)],
                               config=fast_config()) as node:
        await node.connect(daemon.address)
        theirs, ours = model(0), model(1)
        theirs(torch.randn(5, 4))  # BatchNorm statistics that differ from ours
        inproc = ml.GossipAverager(node, theirs, group="g", rule="mean", partners=1)
        async with meshd.connect(daemon.data_dir) as client:
            async with ml.GossipAverager(client, ours, group="g", rule="mean", partners=1) as remote:
                assert isinstance(remote, ml.RemoteGossipAverager) and remote.memory == "shared"

                async def two() -> bool:
                    return await remote.live() == 2

                await _poll(two)
                await inproc.step()  # offers its state (the script's is not offered yet: nothing to merge)
                expected = merge_state(ours.state_dict(), [theirs.state_dict()], "mean")
                report = await remote.step(samples=5)
                assert (report.partners, report.merged, remote.round) == (1, 1, 1)
                for name, value in ours.state_dict().items():
                    assert torch.equal(value, expected[name]), name
                assert ours[1].num_batches_tracked.item() == 0  # integer buffers are left alone
                [row] = await client.learning_groups()
                assert row["algorithm"] == "gossip" and row["client"]["syncs"] == 1
                assert row["client"]["memory"] == "shared" and row["client"]["bytes_in"] == 0
            assert await client.learning_groups() == []
