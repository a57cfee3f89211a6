"""DiLoCo across in-process meshd nodes: a member restarted with its identity catches up;
Streaming DiLoCo keeps every member bit-identical and moves 1/P of the model a sync.

Real QUIC and bulk lanes on loopback, tiny models; conditions are waited on
with bounded timeouts (``learning_members.Progress``), never with sleeps.
(tests/daemon/test_learning_sigkill.py SIGKILLs a member process instead.)
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import torch
import trio

import meshd
from learning_members import (
    GROUP, Progress, Trainer, check_caught_up, diloco, fast_config, run_member, shared_full_rounds, tiny_model,
)
from meshnodes import open_nodes


@pytest.mark.parametrize("victim", ["highest", "lowest"])
async def test_a_restarted_member_takes_the_current_state_and_contributes_again(tmp_path, victim):
    """Stop a member's node mid-run (the lowest key: the one the others ask for rosters and
    take the state from; or the highest), let the others go on, start it again on the same
    data dir with another init: it has the same PeerId; before its first step it takes the
    group's current θ, momentum and round; its hash equals the others' for every round it
    reports; and from the next round on its pseudo-gradient is in the others' reductions."""
    config = fast_config()
    progress = Progress()
    async with trio.open_nursery() as nursery:
        first = await nursery.start(run_member, tmp_path / "n0", None, config, progress, 0)
        members = [first] + [await nursery.start(run_member, tmp_path / f"n{i}", first.node.address, config,
                                                 progress, i) for i in (1, 2)]
        members.sort(key=lambda m: m.node.peer_id.key)
        gone = members[0] if victim == "lowest" else members[-1]
        survivors = [m.trainer for m in members if m is not gone]
        key = gone.node.peer_id.key
        await progress.until(lambda: all(m.trainer.last_round() >= 1 for m in members)  # it contributed
                             and all(t.group.used[key] > 0 for t in survivors), timeout=30)  # before it stopped

        gone.scope.cancel()
        with trio.fail_after(10):
            await gone.stopped.wait()
        stopped_at = max(t.last_round() for t in survivors)
        await progress.until(lambda: all(t.last_round() >= stopped_at + 2 for t in survivors), timeout=30)
        used_before = [t.group.used[key] for t in survivors]
        behind = min(t.group.round for t in survivors)

        bootstrap = next(m for m in members if m is not gone).node.address
        back = await nursery.start(run_member, gone.data_dir, bootstrap, config, progress, 99)  # another init
        assert back.node.peer_id.key == key  # the same identity, from its data dir
        restarted = back.trainer

        def caught_up() -> bool:  # two rounds with it in, as it and the others' reducers saw them
            return len(shared_full_rounds(restarted.hashes, restarted.full_rounds(3), survivors)) >= 2 \
                and all(t.group.used[key] >= used + 2 for t, used in zip(survivors, used_before))

        await progress.until(caught_up, timeout=60)
        nursery.cancel_scope.cancel()

    check_caught_up(restarted.hashes, restarted.full_rounds(3), restarted.opt.resyncs, survivors, behind)


async def test_a_member_gone_quiet_does_not_hold_back_the_hellos_to_the_others(tmp_path):
    """A heartbeat's greetings end together, so a greeting to a stopped member that still looks
    live must give up within a heartbeat: else the live members do not hear each other for the
    exchange timeout's floor (2 s here), time each other out, and fix rosters without each other."""
    config = fast_config()
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 2, config)
        async with AsyncExitStack() as third:
            nodes.append(await third.enter_async_context(meshd.open_node(
                tmp_path / "n2", listen="127.0.0.1:0", bootstrap=[str(nodes[0].address)], config=config)))
            await nodes[2].connect(nodes[0].address)
            groups = [node.service("learning").join(GROUP, algorithm="diloco", rule="mean") for node in nodes]
            with trio.fail_after(10):
                for group in groups:
                    while len(group.live()) < 3:
                        await group._heard.wait()
        a, b, gone = groups  # the third node has stopped
        heartbeat, worst = a.view.heartbeat_interval, 0.0
        with trio.fail_after(10):
            while gone.me in a.view.members or gone.me in b.view.members:  # until both have forgotten it
                with trio.move_on_after(heartbeat):
                    await a._heard.wait()
                worst = max(worst, trio.current_time() - a.view.members[b.me].last_seen)
        worst = max(worst, trio.current_time() - a.view.members[b.me].last_seen)
        assert worst < a.view.dead_after(), f"a heard nothing from b for {worst:.2f} s"
        assert b.me in a.view.live(trio.current_time()) and a.me in b.view.live(trio.current_time())


@pytest.mark.parametrize("fragments", [2, 4])
async def test_streaming_diloco_members_agree_every_outer_step_and_sync_a_pth_of_the_model(tmp_path, fragments):
    """Streaming DiLoCo (``fragments=P``) over real nodes: after every outer step every member
    publishes the same hash of θ and momentum (no resync needed); every fragment's exchange
    had all three members; and each exchange sends 2(N−1)/N of a 1/P share of the model."""
    rounds, members, inner = 3, 3, 8
    progress = Progress()
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, members, fast_config())
        models = [tiny_model(seed, layers=4) for seed in range(members)]  # 4 layers of 16x16 + 16
        trainers = [Trainer(diloco(node, model, inner_steps=inner, fragments=fragments), model, progress, seed=seed)
                    for seed, (node, model) in enumerate(zip(nodes, models))]
        for trainer in trainers:
            await trainer.until_live(members)
        async with trio.open_nursery() as nursery:
            for trainer in trainers:  # the last fragment of round r lands `overlap` steps into round r+1
                nursery.start_soon(trainer.run, rounds * inner + trainer.opt.overlap)

    model_bytes = sum(p.numel() * p.element_size() for p in models[0].parameters())
    per_sync = 2 * (members - 1) / members * model_bytes / fragments
    for trainer in trainers:
        assert sorted(trainer.hashes) == list(range(rounds))
        assert trainer.opt.resyncs == 0
        reports = trainer.opt.reports
        assert sorted((r.round, r.fragment) for r in reports) == [(r, p) for r in range(rounds)
                                                                  for p in range(fragments)]
        assert all(r.contributors == members and r.missing_values == 0 for r in reports)
        for r in reports:
            if r.round >= 1:  # round 0's windows may also count the state others took at the start
                assert 0.9 * per_sync <= r.bytes_out <= 1.1 * per_sync, (r, per_sync)
    for r in range(rounds):
        assert len({t.hashes[r] for t in trainers}) == 1, f"outer step {r}: hashes differ"
    for name in trainers[0].opt.theta:
        assert all(torch.equal(trainers[0].opt.theta[name], t.opt.theta[name]) for t in trainers[1:])
