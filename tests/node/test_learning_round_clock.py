"""What a DiLoCo exchange tells the round clock: how long this member waited for its
result, not how long it then stayed for the others to fetch its slice (in-process meshd
nodes over real QUIC)."""

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


async def test_a_member_that_never_fetches_this_members_slice_does_not_stretch_its_round_clock(tmp_path):
    """The other member sends its part and leaves the round without fetching this member's
    reduced slice (as one that took a later state does).  This member has its whole result
    at once, stays until the round's deadline for the slice to be fetched, and records the
    time to its result: counting the stay made the next timeout 3x the last (30 -> 90 ->
    270 s: learning_robust sat minutes in rounds like this)."""
    config = _config(tmp_path)
    config.learning = LearningSection(heartbeat_interval=0.5, discover_interval=0.5, round_timeout_min=3.0,
                                      round_timeout_max=3.0)  # the deadline: 3 s after the round starts
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 2, config)
        stays, leaves = (node.service("learning").join(GROUP, algorithm="diloco", rule="mean") for node in nodes)
        for group in (stays, leaves):
            group.joined = 0
            group.wake.set()
        with trio.fail_after(30):
            for group in (stays, leaves):
                while len(group.live()) < 2 or any(group.view.members[k].joined is None
                                                   for k in group.live() if k != group.me):
                    await group._heard.wait()

        async def no_fetch(*args) -> None:  # it has left the round: it fetches nothing
            return None

        leaves._fetch_reduced = no_fetch
        results = {}

        async def sync(group, value: float) -> None:
            flat = torch.full((4096,), value)
            results[group.me] = await group.allreduce((0, 0), flat, samples=1, encode=lambda t: encode(t, "none"),
                                                      decode=decode, reduce=_mean, stream=False)

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync, stays, 1.0)
            nursery.start_soon(sync, leaves, 3.0)
        took = trio.current_time() - started

    avg, missing, used = results[stays.me]
    assert missing == [] and set(used) == {stays.me, leaves.me}  # its result was whole
    assert torch.equal(avg, torch.full((4096,), 2.0))
    assert took >= 2.5  # it stayed (nearly) to the deadline for its slice to be fetched ...
    assert stays.clock._seen and stays.clock._seen[-1] < 1.5, list(stays.clock._seen)  # ... and did not count it
