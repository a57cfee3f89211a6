"""Training across in-process meshd nodes (real QUIC on loopback, real tensors).

Members find each other through the DHT and hellos; DiLoCo members end every
outer round with bit-identical parameters and momentum; a gossip round pulls
live partners' parameters; a group answers for what it knows.
"""

from __future__ import annotations

import copy
import threading
from contextlib import AsyncExitStack

import pytest
import torch
import trio
import trio.testing

import meshd
from meshnodes import open_nodes
import meshd.learning as ml
from meshd.identity import PeerId
from learn.outer import state_hash
from meshd.services.learning import group as group_module
from meshd.services.learning.diloco import _split
from meshd import Config
from meshd.services.learning import LearningSection

GROUP = "run42"


def _config(tmp_path) -> Config:
    config = Config()
    config.learning = LearningSection(heartbeat_interval=0.2, discover_interval=0.5, round_timeout_min=2.0)
    return config


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _hash(state: dict) -> bytes:
    """The state hash of a whole state named theta/NAME and momentum/NAME, as a resync computes it."""
    return state_hash(*_split(state))


def _threes(opt) -> dict:
    """A whole state for ``opt``'s model, named as a resync takes it: θ all 3.0, momentum zero."""
    return {**{f"theta/{n}": torch.full_like(t, 3.0) for n, t in opt.theta.items()},
            **{f"momentum/{n}": torch.zeros_like(t) for n, t in opt.theta.items()}}


async def _train(opt, model, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        await opt.step(samples=16)


async def _everyone_knows_everyone(nodes, timeout=10.0) -> None:
    with trio.fail_after(timeout):
        for node in nodes:
            group = node.service("learning").groups[GROUP]
            while len(group.live()) < len(nodes):
                await group._heard.wait()


async def _alone_after_round_0(stack: AsyncExitStack, tmp_path):
    """One member of GROUP (H=2) on a node of its own, done with round 0 alone: (node, model, optimizer)."""
    node, = await open_nodes(stack, tmp_path, 1, _config(tmp_path))
    model = _model(seed=0)
    opt = ml.DiLoCo(node, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.05), group=GROUP,
                    inner_steps=2)
    await _train(opt, model, 2, seed=0)
    return node, model, opt


async def _trained_group(stack: AsyncExitStack, tmp_path, seeds: list[int], *, inner_steps: int, steps: int):
    """In-process DiLoCo members of GROUP, one per model seed, that have trained ``steps``
    steps together: (nodes, models, optimizers)."""
    nodes = await open_nodes(stack, tmp_path, len(seeds), _config(tmp_path))
    models = [_model(seed=seed) for seed in seeds]
    opts = [ml.DiLoCo(node, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.05),
                      group=GROUP, inner_steps=inner_steps) for node, model in zip(nodes, models)]
    await _everyone_knows_everyone(nodes)
    async with trio.open_nursery() as nursery:
        for i, (opt, model) in enumerate(zip(opts, models)):
            nursery.start_soon(_train, opt, model, steps, i)
    return nodes, models, opts


@pytest.mark.parametrize("compression, lanes", [("none", "all"), ("int8", "all"), ("none", "not n2"),
                                                ("none", "small sets")])
async def test_diloco_members_end_each_outer_round_with_identical_state(tmp_path, compression, lanes):
    """Payloads go over the bulk lanes between members that have them, over QUIC to and from one
    that has none; a set smaller than ``lane_min_bytes`` (the default 1 MiB here) goes over QUIC."""
    config = _config(tmp_path)
    config.learning.lane_min_bytes = 1 << 20 if lanes == "small sets" else 0
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 2, config)
        laneless = copy.deepcopy(config)
        laneless.learning.lane = lanes != "not n2"
        nodes.append(await stack.enter_async_context(meshd.open_node(
            tmp_path / "n2", listen="127.0.0.1:0", bootstrap=[str(nodes[0].address)], config=laneless)))
        await nodes[2].connect(nodes[0].address)
        models = [_model(seed=i) for i in range(3)]  # different inits: the group takes one
        opts = [ml.DiLoCo(node, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.05),
                          group=GROUP, inner_steps=5, compression=compression)
                for node, model in zip(nodes, models)]
        await _everyone_knows_everyone(nodes)
        async with trio.open_nursery() as nursery:
            for i, (opt, model) in enumerate(zip(opts, models)):
                nursery.start_soon(_train, opt, model, 15, i)
        hashes = {opt.group.hash for opt in opts}
        assert len(hashes) == 1 and None not in hashes
        assert all(opt.group.hash_round == 2 for opt in opts)
        assert all(r.contributors == 3 and r.missing_values == 0 for opt in opts for r in opt.reports), \
            [[(r.round, r.contributors, r.missing_values, round(r.seconds, 2)) for r in opt.reports] for opt in opts]
        for name in opts[0].theta:
            assert all(torch.equal(opts[0].theta[name], opt.theta[name]) for opt in opts[1:])
        for opt, model in zip(opts, models):  # the sync's buffer was the parameters: θ is back in them
            assert opt._flat is not None
            assert all(torch.equal(p, opt.theta[n]) for n, p in model.named_parameters())
        bulk = [node.service("learning").bulk for node in nodes]
        if lanes == "small sets":
            assert all(b.lent == b.fetched == 0 for b in bulk) and all(opt.group.bytes_in for opt in opts)
            return
        assert bulk[0].fetched > 0 and bulk[1].fetched > 0  # each reduces a slice: fetches parts
        assert (bulk[2].lent > 0 and bulk[2].fetched > 0) if lanes == "all" else (bulk[2].lent == bulk[2].fetched == 0)
        moved, received = sum(b.fetched for b in bulk), sum(sum(opt.group.bytes_in.values()) for opt in opts)
        assert moved == sum(b.lent for b in bulk)
        assert moved == received if lanes == "all" else moved < received  # the rest came over QUIC


@pytest.mark.parametrize("lane", [True, False])
async def test_a_reducer_adds_the_parts_it_is_sent_as_they_stream_in_and_holds_none_whole(tmp_path, monkeypatch, lane):
    """With the mean rule each reducer adds the parts of its slice chunk by chunk as they come
    (over the bulk lane, or over QUIC): no part of more than a chunk is ever held whole, and
    every member ends each round with the same state."""
    held = []
    fresh = group_module._fresh
    monkeypatch.setattr(group_module, "_fresh", lambda name, codec, n: held.append(name) or fresh(name, codec, n))
    config = _config(tmp_path)
    config.learning.lane = lane
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 3, config)
        models = [torch.nn.Linear(1024, 1024) for _ in nodes]  # 4 MiB: each part is over a chunk (1 MiB)
        opts = [ml.DiLoCo(node, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.05), group=GROUP,
                          inner_steps=2) for node, model in zip(nodes, models)]
        await _everyone_knows_everyone(nodes)
        async with trio.open_nursery() as nursery:
            for opt, model in zip(opts, models):
                nursery.start_soon(_train_wide, opt, model, 6)
    assert {opt.group.hash for opt in opts} != {None} and len({opt.group.hash for opt in opts}) == 1
    assert all(r.contributors == 3 and r.missing_values == 0 for opt in opts for r in opt.reports)
    assert sum(len(opt.reports) for opt in opts) == 9
    assert "slice" not in held  # (states taken at the start are held whole: they are named theta/ and momentum/)
    assert (sum(node.service("learning").bulk.fetched for node in nodes) > 0) == lane


async def _train_wide(opt, model, steps: int) -> None:
    gen = torch.Generator().manual_seed(id(opt) % 1000)
    for _ in range(steps):
        model(torch.randn(4, 1024, generator=gen)).pow(2).mean().backward()
        await opt.step(samples=4)


@pytest.mark.parametrize("how", ["cancelled", "failed"])
async def test_an_exchange_that_does_not_finish_leaves_the_parameters_at_theta(tmp_path, how):
    """The parameters hold Δ and then the average during a sync: one that ends early puts θ back."""
    async with AsyncExitStack() as stack:
        node, = await open_nodes(stack, tmp_path, 1, _config(tmp_path))
        model = _model(seed=0)
        opt = ml.DiLoCo(node, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.05), group=GROUP,
                        inner_steps=2)
        entered = trio.Event()

        async def exchange(round_, p, delta, samples):
            delta.fill_(7.0)  # what a half-done exchange leaves: neither Δ nor θ
            entered.set()
            if how == "failed":
                raise RuntimeError("the exchange broke")
            await trio.sleep_forever()

        opt._exchange = exchange
        await _train(opt, model, 1, seed=0)
        assert not all(torch.equal(p, opt.theta[n]) for n, p in model.named_parameters())  # it trained
        async with trio.open_nursery() as nursery:
            async def sync() -> None:
                with pytest.raises(RuntimeError) if how == "failed" else trio.CancelScope():
                    await _train(opt, model, 1, seed=1)

            nursery.start_soon(sync)
            await entered.wait()
            nursery.cancel_scope.cancel()
        assert all(torch.equal(p, opt.theta[n]) for n, p in model.named_parameters())


async def test_a_state_taken_during_a_sync_returns_the_training_at_once_and_leaves_the_exchange_its_vector(tmp_path):
    """The parameters are the sync's vector (parts are lent from it).  A state taken meanwhile
    makes the exchange moot here: the step returns at once with the model holding that
    state's θ in a new vector, and the exchange goes on in the background (others may
    still fetch the slice it reduces) with its own vector untouched by the training."""
    async with AsyncExitStack() as stack:
        node, = await open_nodes(stack, tmp_path, 1, _config(tmp_path))
        model = _model(seed=0)
        opt = ml.DiLoCo(node, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.05), group=GROUP,
                        inner_steps=2)
        await _train(opt, model, 1, seed=0)
        taken = _threes(opt)
        release, seen = trio.Event(), {}

        async def exchange(round_, p, delta, samples):
            before = delta.clone()
            opt._apply(b"\x01" * 32, 5, dict(taken), _hash(taken), path="pull", seconds=0.0)  # as a resync would
            await release.wait()
            seen["kept"] = torch.equal(delta, before)
            return {"round": round_, "avg": delta, "taken": opt._taken - 1}

        opt._exchange = exchange
        with trio.fail_after(10):
            await _train(opt, model, 1, seed=1)  # returns while the exchange waits
        assert "kept" not in seen
        assert all(torch.equal(p, torch.full_like(p, 3.0)) for p in model.parameters())
        assert opt.group.round == 5 and opt.steps == 10
        await _train(opt, model, 1, seed=2)  # the training goes on from the state taken
        assert not all(torch.equal(p, torch.full_like(p, 3.0)) for p in model.parameters())
        release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert seen["kept"]


async def test_a_state_of_the_round_being_exchanged_is_stepped_with_that_rounds_outcome(tmp_path):
    """A member whose hash was off takes the majority's state of round r while its own round-r
    exchange is under way (its parts are with the reducers already): that exchange is not moot,
    its outcome steps the state taken, and the member goes on to round r + 1.  (Training round
    r again instead sent every part twice, was refused by every reducer and split the group:
    learning_robust's honest trimmed_mean runs that took 17-33 resyncs.)"""
    from learn.outer import OuterSGD

    async with AsyncExitStack() as stack:
        node, model, opt = await _alone_after_round_0(stack, tmp_path)
        assert (opt.group.round, opt.steps) == (1, 2)
        theta = {n: torch.full_like(t, 3.0) for n, t in opt.theta.items()}
        momentum = {n: torch.full_like(t, 0.5) for n, t in opt.theta.items()}
        taken = {**{f"theta/{n}": t.clone() for n, t in theta.items()},
                 **{f"momentum/{n}": t.clone() for n, t in momentum.items()}}

        async def exchange(round_, p, delta, samples):
            before = opt._taken
            opt._apply(b"\x01" * 32, round_, dict(taken), _hash(taken), path="pull", seconds=0.0)  # the same round
            delta.fill_(0.25)  # the group's average, landed in the exchange's vector
            return {"round": round_, "avg": delta, "taken": before}

        opt._exchange = exchange
        with trio.fail_after(10):
            await _train(opt, model, 2, seed=1)  # round 1's sync
        expected = OuterSGD()
        expected.momentum = {n: t.clone() for n, t in momentum.items()}
        expected.step(theta, {n: torch.full_like(t, 0.25) for n, t in theta.items()})
        assert all(torch.equal(opt.theta[n], theta[n]) for n in theta)
        assert all(torch.equal(p.detach(), theta[n]) for n, p in model.named_parameters())
        assert (opt.group.hash_round, opt.group.round, opt.steps, opt.resyncs) == (1, 2, 4, 1)


async def test_the_outer_step_leaves_the_node_answering_and_the_state_offered_is_the_stepped_one(tmp_path):
    """A large model's outer step and hash take seconds: they run off the node's loop, so
    a peer's ping is answered meanwhile, and a pull of the state begun meanwhile waits
    and gets the new round's (not θ half stepped)."""
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 2, _config(tmp_path))
        model = _model(seed=0)
        opt = ml.DiLoCo(nodes[0], model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.05), group=GROUP,
                        inner_steps=2)
        await _train(opt, model, 1, seed=0)
        seen: dict = {}

        async def pull() -> None:
            async for frame in opt.group.serve_pull(nodes[1].peer_id, "state", lane=False):
                seen["pulled"] = (frame["contribution"]["round"], seen.get("stepped", False))
                break

        step = opt.outer.step

        def stepping(theta, delta):
            seen["ping"] = trio.from_thread.run(nodes[1].ping, nodes[0].peer_id)  # raises on the loop's thread
            trio.from_thread.run_sync(nursery.start_soon, pull)
            trio.from_thread.run(trio.testing.wait_all_tasks_blocked)  # the pull waits for the new state
            result = step(theta, delta)
            seen["stepped"] = True
            return result

        opt.outer.step = stepping
        async with trio.open_nursery() as nursery:
            await _train(opt, model, 1, seed=1)
        assert seen["ping"] > 0
        assert seen["pulled"] == (1, True) and opt.group.hash_round == 0


async def test_streaming_diloco_takes_each_fragments_delta_off_the_nodes_loop(tmp_path):
    """A fragment of a large model is still gigabytes: its Δ is taken in a worker thread."""
    async with AsyncExitStack() as stack:
        node, = await open_nodes(stack, tmp_path, 1, _config(tmp_path))
        model = _model(seed=0)
        opt = ml.DiLoCo(node, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.05), group=GROUP,
                        inner_steps=4, fragments=2)
        threads, delta = [], opt._delta

        def recording(p):
            threads.append(threading.get_ident())
            return delta(p)

        opt._delta = recording
        await _train(opt, model, 8, seed=0)
        assert len(threads) == 4 and threading.get_ident() not in threads


async def test_a_member_whose_dht_is_still_joining_takes_the_groups_state_rather_than_training_alone(
        tmp_path, monkeypatch):
    """A member's first lookup for its group found nobody while its DHT was still joining (5.7 s
    on a loaded machine, measured), so a late joiner trained rounds alone before it took the
    group's state.  Its first look for the group now waits for the DHT to have joined."""
    from meshd.services.dht.service import Dht

    join, held = Dht._join, trio.Event()

    async def held_join(self):
        if self._host.bootstrap:  # the first node has nobody to join through: not held
            await held.wait()
        await join(self)

    monkeypatch.setattr(Dht, "_join", held_join)
    async with AsyncExitStack() as stack:
        first, = await open_nodes(stack, tmp_path, 1, _config(tmp_path))
        model = _model(seed=0)
        ahead = ml.DiLoCo(first, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.05), group=GROUP,
                          inner_steps=2)
        await _train(ahead, model, 4, seed=0)  # two rounds alone: the group's state is of round 2
        late = await stack.enter_async_context(meshd.open_node(
            tmp_path / "late", listen="127.0.0.1:0", bootstrap=[str(first.address)], config=_config(tmp_path)))
        joiner = _model(seed=1)
        opt = ml.DiLoCo(late, joiner, inner_opt=torch.optim.SGD(joiner.parameters(), lr=0.05), group=GROUP,
                        inner_steps=2)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(opt.start)
            await trio.testing.wait_all_tasks_blocked()  # its first look for the group waits, or is done
            held.set()
        assert [(t["peer"], t["round"]) for t in opt.taken_states] == [(first.peer_id.key, 2)]


async def test_a_gossip_round_merges_live_partners_parameters(tmp_path):
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 3, _config(tmp_path))
        models = [_model(seed=i) for i in range(3)]
        avgs = [ml.GossipAverager(node, model, group=GROUP, rule="mean", partners=2, seed=i)
                for i, (node, model) in enumerate(zip(nodes, models))]
        for avg in avgs:
            avg.group.offer("params", 0, avg._named())
        await _everyone_knows_everyone(nodes)
        before = [torch.cat([p.detach().flatten() for p in m.parameters()]) for m in models]
        report = await avgs[0].step()
        after = torch.cat([p.detach().flatten() for p in models[0].parameters()])
        assert report.merged == 2 and report.bytes_in > 0
        assert torch.allclose(after, torch.stack(before).mean(dim=0), atol=1e-6)


async def test_learning_status_names_members_and_their_agreement(tmp_path):
    async with AsyncExitStack() as stack:
        nodes, models, opts = await _trained_group(stack, tmp_path, [0, 0], inner_steps=3, steps=3)
        control = nodes[0].service("learning").control_methods()
        group = opts[0].group
        with trio.fail_after(10):  # a stall of this loaded process may have the other look quiet a moment
            while len(group.live()) < 2:
                await group._heard.wait()
        [summary] = await control["learning.ls"]({}, None)
        assert summary["group"] == GROUP and summary["algorithm"] == "diloco" and summary["live"] == 2
        assert summary["bytes_out"] > 0
        status = await control["learning.status"]({"group": GROUP}, None)
        assert {m["peer"] for m in status["members"]} == {str(n.peer_id) for n in nodes}
        with pytest.raises(meshd.rpc.NotFound, match="not in group"):
            await control["learning.status"]({"group": "other"}, None)


async def test_a_round_has_one_roster_even_where_members_views_differ(tmp_path):
    config = Config()
    config.learning = LearningSection(heartbeat_interval=30.0, discover_interval=30.0, round_timeout_min=2.0)
    async with AsyncExitStack() as stack:
        groups = await _three_groups(stack, tmp_path, config)
        lowest, highest = groups[0], groups[-1]
        highest.view.drop(lowest.me)  # the highest member has lost sight of the lowest
        assert lowest.me not in highest.contributors(0)
        everyone = sorted(g.me for g in groups)
        assert await highest.roster(0) == everyone  # taken from the middle one, which took it from the lowest
        assert await lowest.roster(0) == everyone


async def _three_groups(stack, tmp_path, config) -> list:
    """Three members of one group that have heard each other, lowest key first."""
    nodes = await open_nodes(stack, tmp_path, 3, config)
    groups = sorted((node.service("learning").join(GROUP, algorithm="diloco", rule="mean") for node in nodes),
                    key=lambda g: g.me)
    with trio.fail_after(10):
        for group in groups:
            for other in groups:
                if other is not group:
                    group.heard_of(other.me)
                    group.wake.set()
            while len(group.live()) < 3:
                await group._heard.wait()
    return groups


async def test_a_roster_fixed_otherwise_than_the_round_befores_is_logged_with_the_view(tmp_path, caplog):
    """What a split round starts from (a roster fixed from a view that lost a member) is in the log."""
    config = Config()
    config.learning = LearningSection(heartbeat_interval=30.0, discover_interval=30.0, round_timeout_min=2.0)
    async with AsyncExitStack() as stack:
        groups = await _three_groups(stack, tmp_path, config)
        lowest, middle = groups[0], groups[1]
        with caplog.at_level("INFO", logger="meshd.learning"):
            assert len(await lowest.roster(0)) == 3
            assert not [r for r in caplog.records if "fixed round" in r.message]  # the first: nothing to compare
            # the lowest loses sight of the middle and hears it no more: a greeting still in
            # flight from the start put it back once (CI), on round 1 as it was on round 0's roster
            lowest.view.drop(middle.me)
            take = lowest.hello_from
            lowest.hello_from = lambda peer, info: None if peer.key == middle.me else take(peer, info)
            lowest.round = 1
            assert middle.me not in await lowest.roster(1)
        [record] = [r for r in caplog.records if "fixed round 1's roster" in r.message]
        assert "2 members, -1 on round 0's" in record.message
        assert PeerId(groups[2].me).short() in record.message and PeerId(middle.me).short() not in record.message


async def test_a_member_on_the_last_roster_stays_on_before_its_hello_says_it_joined(tmp_path):
    """A round can end before the hello that says a member took the state at the start (no hellos here)."""
    config = Config()
    config.learning = LearningSection(heartbeat_interval=30.0, discover_interval=30.0, round_timeout_min=2.0)
    async with AsyncExitStack() as stack:
        groups = await _three_groups(stack, tmp_path, config)
        lowest = groups[0]
        everyone = sorted(g.me for g in groups)
        assert await lowest.roster(0) == everyone  # at the start: members that have not said, in round 0
        lowest.round = 1
        assert all(m.joined is None and m.round == 0 for m in lowest.view.members.values())
        assert await lowest.roster(1) == everyone


def _as_after_a_stall(groups, seconds: float) -> None:
    """Put each group's view where a stall of its process for ``seconds`` leaves it: every
    member last heard ``seconds`` earlier (the hellos meanwhile went unread)."""
    for group in groups:
        for member in group.view.members.values():
            member.last_seen -= seconds


async def test_a_stall_of_the_members_own_process_does_not_leave_the_others_off_its_roster(tmp_path):
    """After the stall the others' next hellos must reach the lowest within its two heartbeats'
    grace, so the heartbeat here is 0.5 s, not the 0.2 s of the other tests (0.4 s was not
    always enough on 2 loaded cores)."""
    config = _config(tmp_path)
    config.learning.heartbeat_interval = 0.5
    async with AsyncExitStack() as stack:
        groups = await _three_groups(stack, tmp_path, config)
        lowest = groups[0]
        _as_after_a_stall(groups, 1.6 * lowest.view.dead_after())
        assert lowest.view.live(trio.current_time()) == []
        with trio.fail_after(10):
            assert await lowest.roster(0) == sorted(g.me for g in groups)


async def test_a_stall_of_the_asker_during_its_ask_does_not_drop_the_member_below_from_the_roster(tmp_path):
    """The middle member asks the lowest for the roster; the lowest is slow to answer, and the
    middle's process stalls meanwhile (the lowest's hellos go unread), so the ask ends with the
    lowest looking quiet.  Dropping it then fixed a roster without it on the middle member only
    (a split round in learning_churn); the middle now gives it two heartbeats to be heard, and
    asks it again."""
    async with AsyncExitStack() as stack:
        groups = await _three_groups(stack, tmp_path, _config(tmp_path))
        lowest, middle = groups[0], groups[1]
        answer, slow = lowest.serve_roster, [True]

        async def slow_at_first(peer, arg):
            if slow and slow.pop():
                await trio.sleep_forever()  # no answer: the middle's ask gives up and cancels this
            return await answer(peer, arg)

        lowest.serve_roster = slow_at_first
        heard, stalled = middle.view.heard, [True]

        def unread_while_stalled(peer, info, now):
            if stalled and peer == lowest.me:
                return middle.view.members[peer]
            return heard(peer, info, now)

        middle.view.heard = unread_while_stalled
        ask = middle._while_heard

        async def the_stall_ends_as_the_ask_fails(*args):
            try:
                return await ask(*args)
            finally:
                stalled.clear()

        middle._while_heard = the_stall_ends_as_the_ask_fails
        with trio.fail_after(10):
            assert await middle.roster(0) == sorted(g.me for g in groups)
        assert not stalled and not slow  # the ask did fail once, with the lowest looking quiet


async def test_a_greeting_slow_to_answer_after_a_stall_does_not_forget_the_member(tmp_path, monkeypatch):
    """After a stall of its process a member sees the others quiet; a greeting then slower
    than a heartbeat forgot them at once, so the next roster it fixed left them off (a split
    round in learning_churn).  Only a member quiet past a stall's reach is forgotten now."""
    async with AsyncExitStack() as stack:
        groups = await _three_groups(stack, tmp_path, _config(tmp_path))
        lowest, other = groups[0], groups[1]
        call = lowest._host.rpc.call

        async def slow_hello(peer, method, *args, **kwargs):
            if method == "learning.hello":
                await trio.sleep_forever()  # no answer: greet's timeout (a heartbeat) ends the call
            return await call(peer, method, *args, **kwargs)

        monkeypatch.setattr(lowest._host.rpc, "call", slow_hello)
        _as_after_a_stall([lowest], 1.6 * lowest.view.dead_after())
        await lowest.greet(PeerId(other.me))
        assert other.me in lowest.view.members


async def test_a_reduced_slice_is_kept_for_a_member_off_the_roster_that_only_looks_quiet(tmp_path):
    """A reducer whose process stalled as its round ended saw the member off the roster
    quiet, dropped its slice, and that member found none (its round came out otherwise,
    learning_churn).  The slice is kept for one quiet no longer than a stall explains."""
    from learn.compress import encode

    async with AsyncExitStack() as stack:
        groups = await _three_groups(stack, tmp_path, _config(tmp_path))
        lowest = groups[0]
        for stall, kept in ((1.6, True), (4, False)):  # in dead-after spans; 4: gone, no copy kept
            exchange = group_module.Exchange((0, 0), roster=[g.me for g in groups[:2]])
            exchange.served_all.set()  # the member on the roster has it
            value = torch.ones(16)
            exchange.offer = lowest._sign(0, "reduced:0:0", [("slice", encode(value, "none"))], 0)
            _as_after_a_stall([lowest], stall * lowest.view.dead_after())
            await lowest._release_reduced(exchange, value, trio.current_time())
            assert (exchange.offer is not None) == kept


async def test_a_roster_held_above_is_taken_from_members_busy_when_first_asked(tmp_path):
    """The lowest member, back after the others fixed a round without it, must take their roster
    rather than fix one of its own, though they take longer than a heartbeat to answer at first."""
    async with AsyncExitStack() as stack:
        groups = await _three_groups(stack, tmp_path, _config(tmp_path))
        lowest, others = groups[0], groups[1:]
        theirs = sorted(g.me for g in others)
        for group in others:
            group._rosters[0] = theirs
            answer, busy = group.serve_roster, [True]

            async def slow_at_first(peer, arg, answer=answer, busy=busy):
                if busy.pop() if busy else False:
                    await trio.sleep_forever()  # busy: the asker's first try times out and cancels this
                return await answer(peer, arg)

            group.serve_roster = slow_at_first
        with trio.fail_after(10):
            assert await lowest.roster(0) == theirs


async def test_a_group_that_stalled_past_its_timeout_finds_itself_again(tmp_path):
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 3, _config(tmp_path))
        avgs = [ml.GossipAverager(node, _model(seed=i), group=GROUP) for i, node in enumerate(nodes)]
        await _everyone_knows_everyone(nodes)
        groups = [avg.group for avg in avgs]
        _as_after_a_stall(groups, 3 * groups[0].view.dead_after())  # every member looks gone
        assert all(len(group.view.live(trio.current_time())) == 0 for group in groups)
        with trio.fail_after(10):
            await _everyone_knows_everyone(nodes)


@pytest.mark.parametrize("compression", ["none", "int8"])
async def test_a_member_off_the_roster_follows_the_round_to_the_same_state(tmp_path, compression):
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 2, _config(tmp_path))
        models = [_model(seed=i) for i in range(2)]
        opts = [ml.DiLoCo(node, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.05),
                          group=GROUP, inner_steps=2, compression=compression)
                for node, model in zip(nodes, models)]
        await _everyone_knows_everyone(nodes)
        first = min(opts, key=lambda o: o.group.me)
        for opt in opts:
            opt.group._rosters[0] = [first.group.me]  # round 0's roster names one member: the other follows
        async with trio.open_nursery() as nursery:
            for i, (opt, model) in enumerate(zip(opts, models)):
                nursery.start_soon(_train, opt, model, 2, i)
        assert [r.contributors for opt in opts for r in opt.reports] == [1, 1]
        assert opts[0].group.hash == opts[1].group.hash is not None


async def test_settle_ends_a_member_whose_last_round_came_out_otherwise_in_the_groups_state(tmp_path):
    """After the last step no later round's hash check puts a member right whose last
    exchange came out otherwise (a slice it missed): ``settle`` takes the majority's state
    then, and returns once it is applied.  A member that agrees takes nothing."""
    async with AsyncExitStack() as stack:
        _, _, opts = await _trained_group(stack, tmp_path, [0, 1, 2], inner_steps=5, steps=10)
        off = opts[2]
        with torch.no_grad():
            for t in off.theta.values():
                t.add_(1.0)  # its round 1 came out otherwise
        off.group.publish_hash(1, state_hash(off.theta, off.outer.momentum))
        off.group.wake.set()
        taken = len(off.taken_states)

        await off.settle()
        await opts[0].settle()
        assert len(off.taken_states) == taken + 1 and off.taken_states[-1]["round"] == 2
        assert len({opt.group.hash for opt in opts}) == 1
        assert all(torch.equal(off.theta[n], opts[0].theta[n]) for n in opts[0].theta)
        assert opts[0].taken_states == [t for t in opts[0].taken_states if t["round"] == 0]


async def test_a_state_taken_is_offered_on_under_its_own_round(tmp_path):
    """A member that takes round 5's state (it was behind, at round 1) hands that state out
    as round 5's, to ``learning.pull`` and to shard sync alike.  (It was offered under the
    round the member had left: a straggler syncing that round took it as one its own
    exchange's outcome was to step, waited for parts the group never sent, and stalled
    learning_robust to its parts deadline.)"""
    async with AsyncExitStack() as stack:
        node, model, opt = await _alone_after_round_0(stack, tmp_path)
        assert opt.group.round == 1
        taken = _threes(opt)
        opt._solo = False  # a member of a group, not one that trained ahead alone
        opt._apply(b"\x01" * 32, 5, dict(taken), _hash(taken), path="pull", seconds=0.0)
        assert opt.group.round == 5
        async for frame in opt.group.serve_pull(PeerId(b"\x02" * 32), "state", lane=False):
            assert frame["contribution"]["round"] == 5
            break
        version, round_, tensors, hash_of = opt._shared_state()
        assert round_ == 5 and hash_of() == _hash(taken)


async def test_a_state_served_to_a_joiner_counts_apart_from_the_members_exchange_bytes(tmp_path):
    """Serving a joiner the state (θ and the outer momentum) is not part of any round's
    exchange: it counts in ``state_bytes_out``, and ``bytes_out`` (which a round's SyncReport
    takes its bytes from) stays as the exchanges left it."""
    async with AsyncExitStack() as stack:
        node, model, opt = await _alone_after_round_0(stack, tmp_path)
        group, joiner = opt.group, PeerId(b"\x02" * 32)
        exchanged = sum(group.bytes_out.values())
        async for _ in group.serve_pull(joiner, "state", lane=False):
            pass
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert group.state_bytes_out[joiner.key] >= 2 * model_bytes  # θ and the momentum, at least
        assert sum(group.bytes_out.values()) == exchanged
        [summary] = await node.service("learning").control_methods()["learning.ls"]({}, None)
        assert summary["state_bytes_out"] == group.state_bytes_out[joiner.key]


async def test_a_sync_the_group_left_behind_ends_once_a_later_state_is_taken(tmp_path):
    """A member syncing round r whose group works two rounds ahead takes a state from it; one
    of round r itself (its outcome would step it, but the group never sends round r's parts)
    leaves the sync waiting, so it asks again until a later round's state ends the wait,
    rather than sitting out the parts deadline."""
    async with AsyncExitStack() as stack:
        node, model, opt = await _alone_after_round_0(stack, tmp_path)
        taken = _threes(opt)
        rounds = [1, 3]  # the state each ask takes: round 1's (the round being synced), then round 3's
        asked = []

        async def never_ends(round_, p, delta, samples):  # the group never sends this round's parts
            await trio.sleep_forever()

        async def ahead_of(round_):
            await trio.lowlevel.checkpoint()
            return b"\x01" * 32

        async def resync(peer):
            asked.append(rounds[0])
            opt._apply(peer, rounds.pop(0), dict(taken), _hash(taken), path="pull", seconds=0.0)

        async def next_hello():
            await trio.lowlevel.checkpoint()

        opt._exchange, opt._resync = never_ends, resync
        opt.group.ahead_of, opt.group.next_hello = ahead_of, next_hello
        with trio.fail_after(10):
            await _train(opt, model, 2, seed=1)  # round 1's sync
        assert asked == [1, 3]
        assert (opt.group.round, opt.steps) == (3, 6)
        assert all(torch.equal(p, torch.full_like(p, 3.0)) for p in model.parameters())


async def test_a_node_closed_during_a_sync_fails_the_step_with_a_clear_error(tmp_path):
    """The node stops (its services' tasks cancelled) while a training task outside it
    waits in an outer sync: the step raises ClosedResourceError naming the round, and
    the parameters hold θ again (it raised KeyError, the exchange's result missing)."""
    async with AsyncExitStack() as stack:
        node, model, opt = await _alone_after_round_0(stack, tmp_path)
        entered = trio.Event()

        async def never_ends(round_, p, delta, samples):
            entered.set()
            await trio.sleep_forever()

        async def stop_node():
            await entered.wait()
            node._nursery.cancel_scope.cancel()  # the node stops under the sync

        opt._exchange = never_ends
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stop_node)
                with pytest.raises(trio.ClosedResourceError, match="round 1's exchange"):
                    await _train(opt, model, 2, seed=1)
        assert all(torch.equal(p.detach(), opt.theta[n]) for n, p in model.named_parameters())
