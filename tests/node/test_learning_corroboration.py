"""Whose state DiLoCo members take: one another members corroborate, not one member's word.

A member that says it is far ahead alone, a liar or a runaway that trained on
its own, is not followed by members that agree with each other; the runaway
itself goes back to their state (in-process meshd nodes over real QUIC).
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import torch
import trio
import trio.testing

import meshd
import meshd.learning as ml
from dht.ids import Contact
from learn.compress import encode
from meshnodes import open_nodes
from test_learning_meshd import GROUP, _config, _everyone_knows_everyone, _model, _train


def _diloco(node, model) -> ml.DiLoCo:
    return ml.DiLoCo(node, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.05), group=GROUP,
                     inner_steps=5)


async def test_members_that_agree_do_not_take_the_state_of_one_that_says_it_is_far_ahead(tmp_path):
    """A fourth node says, in its signed hellos, that it works on round 1,000 and offers a state
    of its own making: the three that train together take nothing from it and go on agreeing."""
    async with AsyncExitStack() as stack:
        config = _config(tmp_path)  # heartbeats slower than a round: the hashes must go out as each round
        config.learning.heartbeat_interval = 0.5  # ends, not at the next heartbeat (this failed every time)
        nodes = await open_nodes(stack, tmp_path, 4, config)
        honest, liar_node = nodes[:3], nodes[3]
        models = [_model(seed=i) for i in range(3)]
        opts = [_diloco(node, model) for node, model in zip(honest, models)]
        await _everyone_knows_everyone(honest)
        async with trio.open_nursery() as nursery:  # two rounds together: their state is corroborated
            for i, (opt, model) in enumerate(zip(opts, models)):
                nursery.start_soon(_train, opt, model, 10, i)

        liar = liar_node.service("learning").join(GROUP, algorithm="diloco", rule="mean")
        forged = {f"{kind}/{name}": torch.full_like(t, 1e3) for name, t in models[0].state_dict().items()
                  for kind in ("theta", "momentum")}
        liar.round = 1000
        liar.offer("state", 1000, [(n, encode(t, "none")) for n, t in sorted(forged.items())])
        liar.publish_hash(999, b"\x07" * 32)
        liar.wake.set()
        await _everyone_knows_everyone(nodes)
        with trio.fail_after(10):  # every honest member has heard the claim
            for node in honest:
                group = node.service("learning").groups[GROUP]
                while group.view.members[liar.me].round != 1000:
                    await group._heard.wait()

        async with trio.open_nursery() as nursery:
            for i, (opt, model) in enumerate(zip(opts, models)):
                nursery.start_soon(_train, opt, model, 10, 10 + i)

        for opt in opts:
            assert [t["peer"] for t in opt.taken_states if t["peer"] == liar.me] == []
            assert opt.group.round == 4 and opt.resyncs == 0
        assert len({opt.group.hashes[3] for opt in opts}) == 1
        assert all(p.abs().max() < 100 for model in models for p in model.parameters())


async def test_a_member_that_trained_ahead_alone_goes_back_to_the_state_the_others_agree_on(tmp_path):
    """Three members of a group, one cut off from the others at the start: it trains six rounds
    alone while the two train two together.  Once it hears them, its next round is its own
    alone again (they do not take part in a round so far ahead), so it takes their state,
    four rounds behind its own, and from then on all three agree."""
    async with AsyncExitStack() as stack:
        pair = await open_nodes(stack, tmp_path, 2, _config(tmp_path))
        alone = await stack.enter_async_context(meshd.open_node(tmp_path / "alone", listen="127.0.0.1:0",
                                                                config=_config(tmp_path)))
        nodes = [*pair, alone]
        models = [_model(seed=i) for i in range(3)]
        opts = [_diloco(node, model) for node, model in zip(nodes, models)]
        await _everyone_knows_everyone(pair)
        async with trio.open_nursery() as nursery:
            for i, (opt, model) in enumerate(zip(opts, models)):
                nursery.start_soon(_train, opt, model, 30 if i == 2 else 10, i)
        assert [opt.group.round for opt in opts] == [2, 2, 6]
        assert opts[0].group.hashes[1] == opts[1].group.hashes[1]

        await alone.connect(pair[0].address)
        await alone.service("dht").node.bootstrap([Contact(pair[0].peer_id.key, (str(pair[0].address.hostport),))])
        await _everyone_knows_everyone(nodes, timeout=20.0)
        await _train(opts[2], models[2], 5, 2)  # round 6, with nobody's part but its own
        assert opts[2].reports[-1].contributors == 1
        with trio.fail_after(20):
            while opts[2].group.round != 2:
                await trio.sleep(0.05)
        assert [(t["peer"], t["round"]) for t in opts[2].taken_states] in ([(n.peer_id.key, 2)] for n in pair)

        async with trio.open_nursery() as nursery:
            for i, (opt, model) in enumerate(zip(opts, models)):
                nursery.start_soon(_train, opt, model, 10, 10 + i)
        for opt in opts[:2]:
            assert [t for t in opt.taken_states if t["peer"] == alone.peer_id.key] == []
        assert [opt.group.round for opt in opts] == [4, 4, 4]
        assert len({opt.group.hashes[3] for opt in opts}) == 1



async def test_a_call_refused_by_a_member_behind_is_asked_again_once_its_hellos_say_it_came_near(tmp_path):
    """A member that runs ahead has its parts refused by members two rounds behind ("not
    current here").  Taking the round alone at once let it run further ahead, round
    after round; it now waits for a hello saying the other works on the round before and
    asks again.  It gives up at once on a member past the round, or on another refusal."""
    from meshd.rpc import Unavailable
    from meshd.services.learning import LearningSection

    config = _config(tmp_path)  # no round runs here: a member is dead after 3 heartbeats of silence, 15 s, not
    config.learning = LearningSection(heartbeat_interval=5.0, discover_interval=0.5)  # 0.6 s, so a loaded
    # machine's stall does not drop it from the view mid-test (hellos still go out at once on `wake`)
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 2, config)
        ahead, behind = (node.service("learning").join(GROUP, algorithm="diloco", rule="mean") for node in nodes)
        behind.round = 2
        behind.wake.set()
        with trio.fail_after(30):
            while ahead.view.members.get(behind.me) is None or ahead.view.members[behind.me].round != 2:
                await ahead._heard.wait()
        refused = Unavailable("round 5 is not current here (round 2)")
        async with trio.open_nursery() as nursery:
            asked_again = []

            async def wait() -> None:
                asked_again.append(await ahead._caught_up(behind.me, 5, refused))

            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            assert asked_again == []  # round 2 still: it waits
            behind.round = 4
            behind.wake.set()
        assert asked_again == [True]
        assert not await ahead._caught_up(behind.me, 5, Unavailable("round 5 is over here"))
        behind.round = 7
        behind.wake.set()
        with trio.fail_after(30):
            while ahead.view.members[behind.me].round != 7:
                await ahead._heard.wait()
        assert not await ahead._caught_up(behind.me, 5, refused)  # past the round: no use asking
