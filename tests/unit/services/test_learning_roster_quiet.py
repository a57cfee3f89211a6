"""Asking a member for a roster ends when that member goes quiet: a member that died
without a goodbye costs its silence (the group's dead-after span), not the round's floor.

On trio's MockClock (``autojump_clock``): the waits are simulated time."""

import pytest
import trio
from fakehost import FakeHost

from meshd.identity import Identity
from meshd.rpc import NotFound
from meshd.services.learning import LearningSection
from meshd.services.learning.bulk import Bulk
from meshd.services.learning.group import Group

PEER = Identity.generate().peer_id.key
HEARTBEAT = 1.0  # dead after 3 s of silence


def _group(tmp_path) -> Group:
    config = LearningSection(heartbeat_interval=HEARTBEAT, round_timeout_min=30.0)
    host = FakeHost(tmp_path)
    group = Group(host, config, "run42", algorithm="diloco", rule="mean", bulk=Bulk(host, enabled=False))
    group.view.heard(PEER, {"round": 0}, trio.current_time())
    return group


async def _never() -> None:
    await trio.sleep_forever()


async def test_a_call_to_a_member_that_stays_silent_ends_when_it_goes_quiet(tmp_path, autojump_clock):
    group = _group(tmp_path)
    start = trio.current_time()
    with pytest.raises(trio.TooSlowError, match="went quiet"):
        await group._while_heard(PEER, _never)
    assert trio.current_time() - start == pytest.approx(group.view.dead_after())


async def test_a_member_still_heard_is_waited_for(tmp_path, autojump_clock):
    group = _group(tmp_path)

    async def hello_then_answer() -> str:
        for _ in range(5):  # 5 hellos a heartbeat apart: never quiet for the 3 s dead-after span
            await trio.sleep(HEARTBEAT)
            group.view.heard(PEER, {}, trio.current_time())
        return "roster"

    start = trio.current_time()
    assert await group._while_heard(PEER, hello_then_answer) == "roster"
    assert trio.current_time() - start == pytest.approx(5 * HEARTBEAT)


async def test_after_a_stall_a_member_gets_two_heartbeats_before_it_counts_as_quiet(tmp_path, autojump_clock):
    group = _group(tmp_path)
    autojump_clock.jump(10 * HEARTBEAT)  # this process was busy: the member looks long quiet
    start = trio.current_time()
    with pytest.raises(trio.TooSlowError):
        await group._while_heard(PEER, _never)
    assert trio.current_time() - start == pytest.approx(2 * HEARTBEAT)


async def test_the_calls_own_error_and_answer_come_through(tmp_path, autojump_clock):
    group = _group(tmp_path)

    async def refuse() -> None:
        raise NotFound("no roster of round 3 here")

    async def answer(value: int) -> int:
        return value

    with pytest.raises(NotFound, match="round 3"):
        await group._while_heard(PEER, refuse)
    assert await group._while_heard(PEER, answer, 7) == 7
