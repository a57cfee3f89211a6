"""A training script's session with its node, in one process: the node's control socket, a RemoteDiLoCo.

tests/daemon/test_learning_client.py runs the real thing (a daemon process
among in-process members); here the node is in-process so the test can reach
the session's DiLoCo and make it take another member's state between two of
the script's syncs, as the hash check does, count what crosses the control
socket, and make the shared shadow fail on either side.
"""

from __future__ import annotations

import os
import stat
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import torch
import trio

import meshd
import meshd.learning as ml
from learning_members import fast_config, tiny_model
from meshnodes import open_nodes
from meshd.client import training
from meshd.rpc import InvalidArgument
from learn.outer import state_hash
from meshd.services.learning import shadows
from meshd.services.learning.diloco import _split

H = 2
MEMORY = pytest.mark.parametrize("shared", [True, False], ids=["shared", "socket"])


async def _steps(opt, model: torch.nn.Module, count: int, gen: torch.Generator) -> None:
    for _ in range(count):
        model(torch.randn(4, 16, generator=gen)).pow(2).mean().backward()
        await opt.step(samples=4)


def _files(data_dir: Path) -> list[Path]:
    """The shadow files there are for this node's data dir (both places one may be)."""
    return [f for d in shadows.directories(data_dir) if d.is_dir() for f in d.iterdir()]


async def _until(condition, timeout: float = 10.0) -> None:
    """Until ``condition()`` holds: what another task of this process does once a connection drops."""
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.01)


@MEMORY
async def test_a_state_taken_between_two_syncs_replaces_the_scripts_stale_steps(tmp_path, shared):
    """The script's parameters after the take were trained from the old θ: the daemon drops them,
    runs no exchange, and hands back the state it took (θ and the step count of its round);
    the sync after that is an ordinary one.  Over shared memory the take writes θ into the
    shadow the script maps, between its requests, as a resync in the background does."""
    gen = torch.Generator().manual_seed(0)
    async with meshd.open_node(tmp_path / "n", listen="127.0.0.1:0", config=fast_config()) as node:
        async with meshd.connect(tmp_path / "n") as client:
            model = tiny_model(0)
            opt = ml.DiLoCo(client, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.1), group="g",
                            inner_steps=H, shared_memory=shared)
            await _steps(opt, model, H, gen)  # round 0, alone
            assert (opt.hash_round, opt.round, opt.steps, len(opt.reports)) == (0, 1, H, 1)
            session = node.service("learning").sessions["g"]
            assert opt.memory == session.status()["memory"] == ("shared" if shared else "socket")
            assert (session.bytes_in == 0) == shared and _files(tmp_path / "n") == []
            member = session.opt
            assert all(torch.equal(p.detach(), member.theta[n]) for n, p in model.named_parameters())

            taken = {**{f"theta/{n}": t + 1 for n, t in member.theta.items()},
                     **{f"momentum/{n}": torch.zeros_like(t) for n, t in member.theta.items()}}
            theta = {n: taken[f"theta/{n}"].clone() for n in member.theta}  # _apply adopts the tensors themselves
            member._apply(node.peer_id.key, 5, taken, state_hash(*_split(taken)), path="pull",
                          seconds=0.0)  # as a resync does
            await _steps(opt, model, H, gen)  # trained from the old θ: dropped
            assert opt.resyncs == 1 and opt.steps == 5 * H and opt.round == 5 and len(opt.reports) == 1
            for name, param in model.named_parameters():
                assert torch.equal(param.detach(), theta[name]), name

            await _steps(opt, model, H, gen)  # round 5, from the state taken
            assert (opt.hash_round, opt.round, [r.round for r in opt.reports]) == (5, 6, [0, 5])
            assert opt.hash == member.group.hash
            assert all(torch.equal(p.detach(), member.theta[n]) for n, p in model.named_parameters())
            assert not any(torch.equal(p.detach(), theta[n]) for n, p in model.named_parameters())
            await opt.aclose()
            assert "g" not in node.service("learning").groups


@MEMORY
async def test_a_state_taken_during_streaming_comes_back_whole_not_only_the_next_fragment(tmp_path, shared):
    """Streaming syncs copy only their fragments in and out of a shared shadow; a state taken
    meanwhile rewrote every tensor, and the next sync's answer brings all of them back."""
    gen = torch.Generator().manual_seed(0)
    async with meshd.open_node(tmp_path / "n", listen="127.0.0.1:0", config=fast_config()) as node:
        async with meshd.connect(tmp_path / "n") as client:
            model = tiny_model(0, layers=4)
            opt = ml.DiLoCo(client, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.1), group="g",
                            inner_steps=4, fragments=2, shared_memory=shared)
            await _steps(opt, model, 3, gen)  # fragment 0 starts at step 2 and lands at step 3
            member = node.service("learning").sessions["g"].opt
            assert [(r.round, r.fragment) for r in opt.reports] == [(0, 0)]
            taken = {**{f"theta/{n}": t + 1 for n, t in member.theta.items()},
                     **{f"momentum/{n}": torch.zeros_like(t) for n, t in member.theta.items()}}
            theta = {n: taken[f"theta/{n}"].clone() for n in member.theta}
            member._apply(node.peer_id.key, 5, taken, state_hash(*_split(taken)), path="pull", seconds=0.0)
            await _steps(opt, model, 1, gen)  # step 4 would start fragment 1: its answer is the state taken
            assert opt.steps == 5 * 4  # (no resync counted: no round of its own had ended)
            for name, param in model.named_parameters():  # fragment 0's tensors too
                assert torch.equal(param.detach(), theta[name]), name
            await opt.aclose()


class _Counting:
    """A call stream that counts the bytes sent and received through it."""

    def __init__(self, stream):
        self._stream, self.sent, self.received = stream, 0, 0

    async def send_all(self, data, *args, **kwargs):
        self.sent += len(data)
        return await self._stream.send_all(data, *args, **kwargs)

    async def receive_some(self, *args, **kwargs):
        data = await self._stream.receive_some(*args, **kwargs)
        self.received += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _counted(channel) -> _Counting:
    """Count what a client's call sends and receives on the control socket from now on."""
    framed = channel._framed
    framed.stream = _Counting(framed.stream)
    return framed.stream


@MEMORY
async def test_a_shared_memory_sync_carries_no_tensor_bytes_over_the_socket(tmp_path, shared):
    """A 2 MiB model: over shared memory an outer sync is a few hundred bytes of messages each
    way on the control socket (the same for any model size); over the socket, the model each
    way.  θ reaches the script's model either way."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512, bias=False))
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    async with meshd.open_node(tmp_path / "n", listen="127.0.0.1:0", config=fast_config()) as node:
        async with meshd.connect(tmp_path / "n") as client:
            opt = ml.DiLoCo(client, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.1), group="g",
                            inner_steps=1, shared_memory=shared)
            await opt.start()
            assert opt.memory == ("shared" if shared else "socket") and opt.memory_why is None
            counts = _counted(opt._session.channel)
            for _ in range(3):
                model(torch.randn(4, 512, generator=gen)).pow(2).mean().backward()
                await opt.step(samples=4)
            session = node.service("learning").sessions["g"]
            assert session.syncs == 3 and opt.hash_round == 2
            if shared:
                assert counts.sent < 3 * 1024 and counts.received < 3 * 1024, vars(counts)  # O(1): no tensor
                assert (session.bytes_in, session.bytes_out) == (0, 0)
            else:
                assert counts.sent > 3 * size and counts.received > 3 * size
                assert (session.bytes_in, session.bytes_out) == (4 * size, 3 * size)  # the join's upload too
            assert all(torch.equal(p.detach(), session.opt.theta[n]) for n, p in model.named_parameters())
            await opt.aclose()


async def test_the_shadow_file_lives_only_from_the_offer_until_the_script_mapped_it(tmp_path):
    """The daemon's offer names a 0600 file in a 0700 directory, sized for the declared tensors;
    a script that drops the call before answering leaves no file; one that mapped it has the
    file removed at once (both mappings stay), and after its session nothing is left either."""
    specs = [["w", "float32", [1000]], ["b", "bfloat16", [3]]]
    arg = {"algorithm": "diloco", "group": "g", "inner_steps": 1, "tensors": specs, "memory": "shared"}
    data_dir = tmp_path / "n"
    async with meshd.open_node(data_dir, listen="127.0.0.1:0", config=fast_config()) as node:
        async with meshd.connect(data_dir) as client:
            channel, stream = await client.open_channel("learning.session", arg)
            offer = (await channel.receive())["shadow"]
            path = Path(offer["path"])
            assert _files(data_dir) == [path] and offer["size"] == 4096 + 4032 + 64
            assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
            assert stat.S_IMODE(os.lstat(path.parent).st_mode) == 0o700
            stream.abort()  # the script died before it mapped the file
            await _until(lambda: not path.exists())
            assert not path.parent.exists() and "g" not in node.service("learning").groups

            model = torch.nn.Linear(8, 2)
            opt = ml.DiLoCo(client, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.1), group="g",
                            inner_steps=1)
            await opt.join()
            assert opt.memory == "shared" and _files(data_dir) == []  # mapped: removed already
            model(torch.randn(2, 8)).sum().backward()
            await opt.step()
            assert opt.hash_round == 0
        await _until(lambda: "g" not in node.service("learning").groups)  # the connection closed under it
        assert _files(data_dir) == []


async def test_a_shared_memory_session_takes_no_tensor_frames_and_no_reply_but_a_yes_or_no(tmp_path):
    """After the offer the daemon takes only a yes or a no; over shared memory a sync that
    announces tensors on the socket is refused.  A script that says yes without writing
    anything joins with zeros (its own values, as far as the daemon can tell): no harm."""
    specs = [["w", "float32", [4]]]
    arg = {"algorithm": "diloco", "group": "g", "inner_steps": 1, "tensors": specs, "memory": "shared"}
    async with meshd.open_node(tmp_path / "n", listen="127.0.0.1:0", config=fast_config()) as node:
        async with meshd.connect(tmp_path / "n") as client:
            channel, stream = await client.open_channel("learning.session", arg)
            await channel.receive()
            await channel.send({"tensors": 1})
            with pytest.raises(InvalidArgument, match="shadow"):
                await channel.receive()
            stream.abort()

            channel, stream = await client.open_channel("learning.session", arg)
            await channel.receive()
            await channel.send({"shadow": True})
            answer = await channel.receive()
            assert answer["changed"] is False and answer["tensors"] == 0
            assert torch.equal(node.service("learning").sessions["g"].opt.theta["w"], torch.zeros(4))
            await channel.send({"sync": {"steps": 1}, "tensors": 1})
            with pytest.raises(InvalidArgument, match="sends no tensors, not 1"):
                await channel.receive()
            stream.abort()
        await _until(lambda: "g" not in node.service("learning").groups)
        assert _files(tmp_path / "n") == []


@pytest.mark.parametrize("side", ["daemon", "script"])
async def test_a_shadow_that_cannot_be_made_or_mapped_falls_back_to_the_socket(tmp_path, monkeypatch, side):
    """No room for the file (the daemon's side), or a script that cannot map it: the session
    goes on over the socket, says why, and its syncs work."""
    if side == "daemon":
        monkeypatch.setattr(shadows, "directories", lambda data_dir, **kw: [tmp_path / "missing" / "shadows"])
    else:
        monkeypatch.setattr(training._Session, "_map", lambda self, offer, why: "cannot map it here")
    gen = torch.Generator().manual_seed(0)
    async with meshd.open_node(tmp_path / "n", listen="127.0.0.1:0", config=fast_config()) as node:
        async with meshd.connect(tmp_path / "n") as client:
            model = tiny_model(0)
            opt = ml.DiLoCo(client, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.1), group="g",
                            inner_steps=H)
            await _steps(opt, model, H, gen)
            session = node.service("learning").sessions["g"]
            assert opt.memory == session.status()["memory"] == "socket" and opt.hash_round == 0
            assert ("No such file" if side == "daemon" else "cannot map it here") in opt.memory_why
            assert session.bytes_in > 0 and _files(tmp_path / "n") == []
            assert all(torch.equal(p.detach(), session.opt.theta[n]) for n, p in model.named_parameters())
            await opt.aclose()


@MEMORY
async def test_settle_through_the_daemon_hands_the_script_the_groups_state(tmp_path, shared):
    """A script's member whose last round came out otherwise: ``settle`` has its daemon take
    the group's state from the other two members and the script's model hold it."""
    gen = torch.Generator().manual_seed(0)
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(meshd.open_node(tmp_path / "n0", listen="127.0.0.1:0",
                                                                config=fast_config()))
        nodes = [first]
        for i in (1, 2):
            node = await stack.enter_async_context(meshd.open_node(
                tmp_path / f"n{i}", listen="127.0.0.1:0", config=fast_config(), bootstrap=[str(first.address)]))
            await node.connect(first.address)
            nodes.append(node)
        client = await stack.enter_async_context(meshd.connect(tmp_path / "n2"))
        models = [tiny_model(i) for i in range(3)]
        opts = [ml.DiLoCo(node, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.1), group="g",
                          inner_steps=H) for node, model in zip(nodes[:2], models)]
        opts.append(ml.DiLoCo(client, models[2], inner_opt=torch.optim.SGD(models[2].parameters(), lr=0.1),
                              group="g", inner_steps=H, shared_memory=shared))
        await opts[2].join()
        groups = [node.service("learning").groups["g"] for node in nodes]
        with trio.fail_after(10):
            for group in groups:
                while len(group.live()) < 3:
                    await group._heard.wait()
        async with trio.open_nursery() as nursery:
            for opt, model in zip(opts, models):
                nursery.start_soon(_steps, opt, model, 2 * H, gen)
        member = nodes[2].service("learning").sessions["g"].opt
        with torch.no_grad():
            for t in member.theta.values():
                t.add_(1.0)  # its last round came out otherwise
        member.group.publish_hash(member.group.hash_round, state_hash(member.theta, member.outer.momentum))
        member.group.wake.set()

        await opts[2].settle()
        assert opts[2].hash == opts[0].group.hash == member.group.hash
        assert all(torch.equal(p.detach(), opts[0].theta[n]) for n, p in models[2].named_parameters())


class _Recording(torch.optim.SGD):
    """SGD that keeps a copy of the parameters after every inner step (``after[k]``: after step k + 1)."""

    def __init__(self, model: torch.nn.Module, lr: float):
        super().__init__(model.parameters(), lr=lr)
        self._named = dict(model.named_parameters())
        self.after: list[dict[str, torch.Tensor]] = []

    def step(self, closure=None):
        super().step(closure)
        self.after.append({n: p.detach().clone() for n, p in self._named.items()})


async def _train(opt, model, steps: int, seed: int, hashes: dict[int, bytes], last) -> None:
    """``steps`` inner steps on random batches, noting ``hashes[round]`` as ``last(opt)`` says them."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 16, generator=gen)).pow(2).mean().backward()
        await opt.step(samples=4)
        round_, digest = last(opt)
        if round_ >= 0:
            hashes[round_] = digest


@MEMORY
async def test_streaming_diloco_through_a_node_is_a_member_in_step_with_in_process_ones(tmp_path, shared):
    """Streaming DiLoCo (2 fragments) with a script whose member is its node's session, beside two
    in-process members: every fragment's Δ is taken from the script's parameters at the very
    inner step it is due, every landing mixes θ into its parameters of that step, every outer
    step ends with one hash on all three, every fragment's exchange had the three of them and
    moved about half of what a whole model's would, and the script's model ends holding what
    the session's shadow holds."""
    rounds, inner, fragments = 3, 8, 2
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 3, fast_config())
        client = await stack.enter_async_context(meshd.connect(tmp_path / "n2"))
        models = [tiny_model(seed, layers=4) for seed in range(3)]
        opts = [ml.DiLoCo(node, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.05), group="g",
                          inner_steps=inner, fragments=fragments) for node, model in zip(nodes[:2], models)]
        inner_opt = _Recording(models[2], lr=0.05)
        script = ml.DiLoCo(client, models[2], inner_opt=inner_opt, group="g", inner_steps=inner,
                           fragments=fragments, shared_memory=shared)
        await script.join()
        member = nodes[2].service("learning").sessions["g"].opt
        seen: list[tuple[str, int, dict[str, torch.Tensor]]] = []  # what the member took, at which step
        delta, step = member._delta, member._step

        def taking_delta(p):
            seen.append(("delta", member.steps, {n: member._params[n].clone() for n in member.fragments[p]}))
            return delta(p)

        def landing(names, *args):
            seen.append(("land", member.steps, {n: member._params[n].clone() for n in names}))
            return step(names, *args)

        member._delta, member._step = taking_delta, landing
        groups = [node.service("learning").groups["g"] for node in nodes]
        with trio.fail_after(10):
            for group in groups:
                while len(group.live()) < 3:
                    await group._heard.wait()
        await script.start()  # the group's θ (node 0's: the lowest key's, or another's) into the model
        hashes: list[dict[int, bytes]] = [{}, {}, {}]
        steps = rounds * inner + opts[0].overlap  # the last fragment lands `overlap` steps into the next round
        async with trio.open_nursery() as nursery:
            for i, (opt, model) in enumerate(zip(opts, models[:2])):
                nursery.start_soon(_train, opt, model, steps, i, hashes[i],
                                   lambda o: (o.group.hash_round, o.group.hash))
            nursery.start_soon(_train, script, models[2], steps, 2, hashes[2], lambda o: (o.hash_round, o.hash))
        session = nodes[2].service("learning").sessions["g"]  # the last step landed fragment 1: the model
        last = member.fragments[1]                                 # holds the shadow's values of it
        assert all(torch.equal(p.detach(), session.tensors[n]) for n, p in models[2].named_parameters() if n in last)
        sizes = {n: p.numel() * p.element_size() for n, p in models[2].named_parameters()}
        if not shared:  # each sync carried its fragment only, each way (the join's upload: the whole model)
            fragment_bytes = sum(sizes[n] for n in member.fragments[0])
            syncs = len(inner_opt.after) // (inner // fragments) * 2  # a start and a landing per fragment
            assert session.bytes_in - sum(sizes.values()) <= syncs * fragment_bytes
            assert session.bytes_out <= sum(sizes.values()) + syncs // 2 * fragment_bytes  # θ with each landing

    assert script.resyncs == 0 and len(inner_opt.after) == steps and script.overlap == 2
    begins = range(inner // fragments, steps + 1, inner // fragments)  # fragment 0 at 4, 12, ...; 1 at 8, 16, ...
    assert [(kind, at) for kind, at, _ in seen] == sorted(
        [("delta", s) for s in begins] + [("land", s + 2) for s in begins if s + 2 <= steps], key=lambda e: e[1])
    for kind, at, values in seen:  # the script's own parameters after that inner step
        for name, value in values.items():
            assert torch.equal(value, inner_opt.after[at - 1][name]), (kind, at, name)
    for r in range(rounds):
        assert hashes[0][r] == hashes[1][r] == hashes[2][r], f"outer step {r}: hashes differ"
    reports = script.reports
    assert sorted((r.round, r.fragment) for r in reports) == [(r, p) for r in range(rounds) for p in range(fragments)]
    assert all(r.contributors == 3 and r.missing_values == 0 for r in reports)
    model_bytes = sum(p.numel() * p.element_size() for p in models[2].parameters())
    per_sync = 2 * 2 / 3 * model_bytes / fragments
    assert all(0.9 * per_sync <= r.bytes_out <= 1.1 * per_sync for r in reports if r.round >= 1), reports
