"""A DiLoCo member that leaves cleanly says goodbye (``learning.bye``): the others stop
counting it at once instead of after its silence, and no exchange waits for it.

Real QUIC on loopback, tiny models.  Heartbeats of 1 s make a silent member look live for
3 s, longer than the rounds these tests watch, so without the goodbye the next round's
roster would name the member that left and wait out the round clock for its part.
"""

from __future__ import annotations

import functools

import trio

import meshd
from learning_members import GROUP, INNER_STEPS, Progress, fast_config, run_member


async def test_a_member_whose_node_closes_is_dropped_at_once_and_the_next_rounds_do_not_wait_for_it(tmp_path):
    """The leaver trains rounds 0-2 and closes its node while the others wait after round 2:
    by the time its node has closed both have dropped it, and rounds 3-5 are theirs alone,
    whole (no slice missing) and each quicker than the round clock's floor (the least an
    exchange waits for a part that does not come)."""
    config = fast_config(heartbeat_interval=1.0)
    floor = config.learning.round_timeout_min
    progress = Progress()
    go = trio.Event()
    async with trio.open_nursery() as nursery:
        first = await nursery.start(run_member, tmp_path / "n0", None, config, progress, 0)
        second = await nursery.start(run_member, tmp_path / "n1", first.node.address, config, progress, 1)
        stay = [first, second]
        for member in stay:
            member.trainer.hold = (2, go)
        leaver = await nursery.start(functools.partial(run_member, steps=3 * INNER_STEPS), tmp_path / "n2",
                                     first.node.address, config, progress, 2)
        gone = leaver.node.peer_id.key
        with trio.fail_after(60):
            await leaver.stopped.wait()
        assert leaver.trainer.last_round() == 2
        for member in stay:
            assert gone not in member.trainer.group.view.members, "still counted after its goodbye"
        go.set()
        await progress.until(lambda: all(m.trainer.last_round() >= 5 for m in stay), timeout=60)
        nursery.cancel_scope.cancel()

    for member in stay:
        reports = {r.round: r for r in member.trainer.opt.reports}
        for round_ in (3, 4, 5):
            report = reports[round_]
            assert (report.contributors, report.missing_values) == (2, 0), (round_, report)
            assert report.seconds < floor, (round_, report)
        assert len({m.trainer.hashes[5] for m in stay}) == 1


async def test_a_member_whose_training_is_cancelled_still_says_goodbye(tmp_path):
    """Cancelling the block that holds the node (Ctrl-C in a script, a supervisor's scope)
    stops the training at once, yet the node runs on until its goodbyes are said."""
    config = fast_config(heartbeat_interval=2.0)  # silent members look live for 6 s
    progress = Progress()
    async with trio.open_nursery() as nursery:
        staying = await nursery.start(functools.partial(run_member, count=2), tmp_path / "n0", None, config,
                                      progress, 0)
        leaving = await nursery.start(functools.partial(run_member, count=2), tmp_path / "n1",
                                      staying.node.address, config, progress, 1)
        await progress.until(lambda: all(m.trainer.last_round() >= 1 for m in (staying, leaving)), timeout=60)
        farewell, took = leaving.node.farewell, []

        async def timed() -> None:  # the goodbye's answer comes back: the node still runs
            started = trio.current_time()
            await farewell()
            took.append(trio.current_time() - started)

        leaving.node.farewell = timed
        leaving.scope.cancel()
        with trio.fail_after(3):
            await leaving.stopped.wait()
        assert leaving.node.peer_id.key not in staying.trainer.group.view.members
        assert took and took[0] < 1.0, took  # not cut off at a heartbeat (2 s) waiting for an answer
        nursery.cancel_scope.cancel()


async def test_a_member_that_leaves_the_group_is_dropped_by_the_others_and_may_come_back(tmp_path):
    """``Learning.leave`` (what a daemon does when its training script's session ends) tells
    the members at once; the same node joining again is a member again."""
    config = fast_config(heartbeat_interval=2.0)  # silent members look live for 6 s

    async def seen(group, key, present: bool) -> None:
        while (key in group.view.members) != present:
            await group._heard.wait()

    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0", config=config) as a, \
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0", config=config,
                            bootstrap=[str(a.address)]) as b:
        await b.connect(a.address)
        staying = a.service("learning").join(GROUP, algorithm="diloco", rule="mean")
        learning = b.service("learning")
        learning.join(GROUP, algorithm="diloco", rule="mean")
        key = b.peer_id.key
        with trio.fail_after(10):
            await seen(staying, key, True)
        with trio.fail_after(3):
            learning.leave(GROUP)
            await seen(staying, key, False)
        assert staying.live() == [staying.me]
        learning.join(GROUP, algorithm="diloco", rule="mean").wake.set()
        with trio.fail_after(10):
            await seen(staying, key, True)
