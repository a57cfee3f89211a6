"""How long a DiLoCo exchange lasts when a member on its roster never fetches this
member's slice, and what it tells the round clock: the time to this member's result,
not its stay for the fetch (in-process meshd nodes over real QUIC)."""

from __future__ import annotations

from contextlib import AsyncExitStack

import torch
import trio

from learn.compress import decode, encode
from meshd.services.learning import LearningSection
from meshnodes import open_nodes
from test_learning_meshd import GROUP, _config


def _mean(tensors, weights):
    total = sum(weights)
    return sum(t * (w / total) for t, w in zip(tensors, weights)), []


async def _pair(stack: AsyncExitStack, tmp_path):
    """Two joined members of GROUP that see each other; rounds time out 3 s after they start."""
    config = _config(tmp_path)
    config.learning = LearningSection(heartbeat_interval=0.5, discover_interval=0.5, round_timeout_min=3.0,
                                      round_timeout_max=3.0)
    nodes = await open_nodes(stack, tmp_path, 2, config)
    groups = [node.service("learning").join(GROUP, algorithm="diloco", rule="mean") for node in nodes]
    for group in groups:
        group.joined = 0
        group.wake.set()
    with trio.fail_after(30):
        for group in groups:
            while len(group.live()) < 2 or any(group.view.members[k].joined is None
                                               for k in group.live() if k != group.me):
                await group._heard.wait()
    return groups


async def _round_where_one_never_fetches(stays, leaves, *, then_moves_on: bool) -> tuple[dict, float]:
    """Round 0 of both, ``leaves`` sending its part but fetching nothing (it has left the
    round, as one that took a later state has); with ``then_moves_on`` it then says, in a
    hello, that it works on round 1.  Returns the results by member and ``stays``' seconds."""
    async def no_fetch(*args) -> None:
        return None

    leaves._fetch_reduced = no_fetch
    results, took = {}, {}

    async def sync(group, value: float) -> None:
        started = trio.current_time()
        results[group.me] = await group.allreduce((0, 0), torch.full((4096,), value), samples=1,
                                                  encode=lambda t: encode(t, "none"), decode=decode, reduce=_mean,
                                                  stream=False)
        took[group.me] = trio.current_time() - started
        if group is leaves and then_moves_on:
            group.round = 1
            group.wake.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sync, stays, 1.0)
        nursery.start_soon(sync, leaves, 3.0)
    return results, took[stays.me]


async def test_a_member_that_never_fetches_this_members_slice_does_not_stretch_its_round_clock(tmp_path):
    """This member has its whole result at once, stays until the round's deadline for the
    other to fetch its slice, and records the time to its result: counting the stay made
    the next timeout 3x the last (30 -> 90 -> 270 s: learning_robust sat minutes in rounds
    like this)."""
    async with AsyncExitStack() as stack:
        stays, leaves = await _pair(stack, tmp_path)
        results, took = await _round_where_one_never_fetches(stays, leaves, then_moves_on=False)
    avg, missing, used = results[stays.me]
    assert missing == [] and set(used) == {stays.me, leaves.me}  # its result was whole
    assert torch.equal(avg, torch.full((4096,), 2.0))
    assert took >= 2.5  # it stayed (nearly) to the deadline for its slice to be fetched ...
    assert stays.clock._seen and stays.clock._seen[-1] < 1.5, list(stays.clock._seen)  # ... and did not count it


async def test_a_member_that_says_it_works_on_a_later_round_is_not_waited_for(tmp_path):
    """Once the member that never fetched says (in its hellos) that it works on round 1, it
    is done with round 0 and never fetches: this member's round ends then, not at the deadline."""
    async with AsyncExitStack() as stack:
        stays, leaves = await _pair(stack, tmp_path)
        results, took = await _round_where_one_never_fetches(stays, leaves, then_moves_on=True)
    assert results[stays.me][1] == []
    assert took < 2.0, took  # the deadline is 3 s after the round starts
