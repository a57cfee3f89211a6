"""A member that joins a DiLoCo group takes the group's state over shard sync (and over
``learning.pull`` when its node runs no shards service), then contributes from the next round.

Real QUIC and bulk lanes on loopback; the group is held after a round (``Trainer.hold``)
so that the joiner finds every member at the same round and hash; conditions are waited on
with bounded timeouts (``learning_members.Progress``), never with sleeps.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio

import meshd
from learning_members import (
    Progress, Trainer, check_caught_up, diloco, fast_config, shared_full_rounds, tiny_model,
)
from meshd.daemon import SERVICES
from meshnodes import open_nodes

HELD = 2  # the round after which the group waits for the joiner
WIDTH = 1024  # 2 layers of 1024x1024 + 1024: θ and momentum 16.8 MB, 5 chunks of 4 MiB


async def _join_a_held_group(tmp_path, *, services=None, min_bytes: int = 0) -> tuple:
    """Three members train until round HELD and wait; a fourth node (``services``) joins with
    another init and takes the state; the group goes on until it has contributed to two full
    rounds.  Every node takes states of ``min_bytes`` or more over shard sync (if it runs the
    shards service).  Returns the joiner, the three others, the joiner's node, the others'
    nodes and each other member's count of published states before the join (by peer key)."""
    config = fast_config(shard_sync_min_bytes=min_bytes)
    progress = Progress()
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 3, config)
        go = trio.Event()
        members = []
        for seed, node in enumerate(nodes):
            model = tiny_model(seed, width=WIDTH)
            members.append(Trainer(diloco(node, model), model, progress, seed=seed, width=WIDTH))
            members[-1].hold = (HELD, go)
        joiner_node = await stack.enter_async_context(meshd.open_node(
            tmp_path / "joiner", listen="127.0.0.1:0", bootstrap=[str(nodes[0].address)], config=config,
            services=services))
        await joiner_node.connect(nodes[0].address)
        async with trio.open_nursery() as nursery:
            async def train(trainer: Trainer, live: int) -> None:
                await trainer.until_live(live, timeout=20)
                await trainer.run()

            for member in members:
                nursery.start_soon(train, member, 3)
            await progress.until(lambda: all(m.last_round() >= HELD for m in members), timeout=60)
            assert all(m.last_round() == HELD for m in members)  # held there
            published = {m.group.me: m.group.published for m in members}

            model = tiny_model(99, width=WIDTH)
            joiner = Trainer(diloco(joiner_node, model), model, progress, seed=99, width=WIDTH)
            nursery.start_soon(train, joiner, 4)
            await progress.until(lambda: HELD in joiner.hashes, timeout=60)  # it took round HELD's outcome
            key = joiner.group.me
            go.set()

            def caught_up() -> bool:
                return len(shared_full_rounds(joiner.hashes, joiner.full_rounds(4), members)) >= 2 \
                    and all(m.group.used[key] >= 2 for m in members)

            await progress.until(caught_up, timeout=60)
            nursery.cancel_scope.cancel()
    check_caught_up(joiner.hashes, joiner.full_rounds(4), joiner.opt.resyncs, members, HELD + 1)
    assert joiner.hashes[HELD] == members[0].hashes[HELD]
    return joiner, members, joiner_node, nodes, published


async def test_a_joining_member_takes_the_state_over_shard_sync_and_contributes_from_the_next_round(tmp_path):
    """The joiner takes θ, momentum and round from the held group through its shards service
    (a fetch to memory from all three members, which each published the same bits once),
    checks it against the hash, ends its first round with the group's hash and is in every
    reduction from the next round on.  The best member keeps one state, the latest: the one
    it published for the members that started with it at round 0 is unpinned and collected."""
    joiner, members, joiner_node, nodes, published = await _join_a_held_group(tmp_path)
    assert joiner.opt.takes == {"shards": 1}, joiner.opt.takes
    taken = joiner.opt.taken_states[0]
    assert taken["round"] == HELD + 1
    shards = joiner_node.service("shards")
    assert len(shards.fetches) == 1
    (model_id, progress), = shards.fetches.items()
    assert progress.have_bytes == progress.total_bytes == taken["bytes"] > 0
    providers = {str(node.peer_id) for node in nodes}
    assert set(progress.providers) == providers, progress.providers  # all three held the same round's state
    assert sum(p["bytes"] for p in progress.providers.values()) >= progress.total_bytes
    assert not shards.manifests() and shards.store.total_bytes() == 0  # nothing was written on the joiner
    print(f"\njoin over shard sync: {taken['bytes']} bytes in {taken['seconds']:.3f} s; per provider: "
          f"{ {k[:8]: (v['bytes'], v['state']) for k, v in progress.providers.items()} }")

    best = min(members, key=lambda m: m.group.me)
    assert best.group.shared.model == model_id and best.group.shared.round == HELD + 1
    for member in members:  # each published once for the joiner (the best one also once at round 0)
        assert member.group.published == published[member.group.me] + 1
        assert member.group.shared.round == HELD + 1
    for node, member in zip(nodes, members):
        store = node.service("shards").store
        kept = node.service("shards").manifests()
        assert [m.id for m in kept] == [member.group.shared.model]  # the one published before is gone
        assert store.total_bytes() == sum({c.id: c.length for c in kept[0].chunks}.values())  # so are its chunks


@pytest.mark.parametrize("why", ["shards off", "small state"])
async def test_a_joining_member_takes_the_state_over_learning_pull_without_shards_or_for_a_small_state(
        tmp_path, why):
    """The same join with the shards service off on the joiner, or with the state (16.8 MB)
    under ``shard_sync_min_bytes`` (the default, 64 MiB): it pulls the state over
    ``learning.pull`` as before, nobody publishes a state for it, and it catches up alike."""
    if why == "shards off":
        kw = {"services": [name for name in SERVICES if name != "shards"]}
    else:
        kw = {"min_bytes": meshd.Config().learning.shard_sync_min_bytes}
        assert 2 * 2 * (WIDTH * WIDTH + WIDTH) * 4 < kw["min_bytes"]
    joiner, members, joiner_node, nodes, published = await _join_a_held_group(tmp_path, **kw)
    assert joiner.opt.takes == {"pull": 1}, joiner.opt.takes
    assert joiner.opt.taken_states[0]["round"] == HELD + 1
    assert (joiner.group.states is None) == (why == "shards off")
    assert {m.group.me: m.group.published for m in members} == published
    taken = joiner.opt.taken_states[0]
    print(f"\njoin over learning.pull ({why}): {taken['bytes']} bytes in {taken['seconds']:.3f} s")
