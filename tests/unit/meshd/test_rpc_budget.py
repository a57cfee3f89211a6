"""The bytes served calls hold are bounded per peer and node-wide; past either, RESOURCE_EXHAUSTED."""

import pytest
import trio
import trio.testing

from meshd.rpc import protocol as P
from meshd.rpc.framed import Framed
from meshd.rpc import ResourceExhausted, RpcServer, client_stream_call, unary_call
from meshd.rpc.budget import ByteBudget, CallBytes, OverBudget
from meshd.wire import frame_parts
from memstream import MemoryCallStream, memory_call_stream_pair

MAX = 4 << 20
MIB = 1 << 20


def test_small_frames_are_not_counted_and_large_ones_are_bounded_per_peer_and_in_all():
    budget = ByteBudget(total=5 * MIB, share=3 * MIB, small=64 << 10)
    assert budget.take("a", (64 << 10) - 1) == 0 and budget.held == 0
    assert budget.take("a", 2 * MIB) == 2 * MIB
    with pytest.raises(OverBudget, match="its share"):
        budget.take("a", 2 * MIB)
    assert budget.take("b", 3 * MIB) == 3 * MIB
    with pytest.raises(OverBudget, match="total"):
        budget.take("c", MIB)
    assert (budget.held, budget.of("a"), budget.refused) == (5 * MIB, 2 * MIB, 2)
    budget.give("b", 3 * MIB)
    assert budget.take("c", MIB) == MIB and budget.held == 3 * MIB


def test_peers_at_one_address_share_its_bytes_and_other_addresses_are_not_held_back():
    budget = ByteBudget(total=64 * MIB, share=3 * MIB, address_share=5 * MIB)
    assert budget.take("a", 3 * MIB, "10.0.0.1") == 3 * MIB
    assert budget.take("b", 2 * MIB, "10.0.0.1") == 2 * MIB
    with pytest.raises(OverBudget, match="address"):  # a third fresh identity on that machine
        budget.take("c", MIB, "10.0.0.1")
    assert budget.take("d", 3 * MIB, "10.0.0.2") == 3 * MIB
    assert budget.take("e", 3 * MIB) == 3 * MIB  # no address given (loopback, a relayed path): not counted
    budget.give("a", 3 * MIB, "10.0.0.1")
    assert budget.take("c", MIB, "10.0.0.1") == MIB


def test_a_call_gives_back_everything_it_held_when_it_ends():
    budget = ByteBudget(share=4 * MIB)
    call = CallBytes(budget, "a")
    first = call.take(MIB)
    call.take(2 * MIB)
    call.give(first)
    assert budget.of("a") == call.held == 2 * MIB
    call.end()
    assert budget.held == budget.of("a") == 0


class Harness:
    """An RpcServer with a byte budget, calls served from a named peer each."""

    def __init__(self, nursery, **server_args):
        self.server = RpcServer(max_frame=MAX, **server_args)
        self.nursery = nursery

    def opener(self, peer: str, stream_pair=memory_call_stream_pair):
        async def open():
            client, server = stream_pair()
            self.nursery.start_soon(self.server.serve_call, server, peer)
            return client
        return open

    async def call(self, peer: str, method: str, arg=None):
        return await unary_call(self.opener(peer), method, arg, 5.0, MAX)


class _Holding:
    """A unary handler that keeps its call running until ``release``; ``running`` counts them."""

    def __init__(self):
        self.release = trio.Event()
        self.running = 0
        self.changed = trio.Event()

    async def __call__(self, arg, ctx):
        self.running += 1
        self.changed.set()
        await self.release.wait()
        return len(arg)

    async def until(self, n: int) -> None:
        while self.running < n:
            self.changed = trio.Event()
            await self.changed.wait()


async def test_a_peer_past_its_share_is_refused_while_others_are_served_and_gets_it_back(nursery):
    h = Harness(nursery, held_bytes=16 * MIB, peer_held_bytes=3 * MIB)
    hold = _Holding()
    h.server.register("hold", hold)
    for _ in range(2):  # "greedy" holds two 1 MiB requests
        nursery.start_soon(h.call, "greedy", "hold", b"x" * MIB)
    await hold.until(2)
    with pytest.raises(ResourceExhausted, match="share of 3145728"):
        await h.call("greedy", "hold", b"x" * (2 * MIB))
    nursery.start_soon(h.call, "honest", "hold", b"y" * (2 * MIB))  # another peer is not held back
    await hold.until(3)
    assert h.server.budget.of("greedy") >= 2 * MIB and h.server.budget.of("honest") >= 2 * MIB
    hold.release.set()
    await trio.testing.wait_all_tasks_blocked()  # the held calls end
    assert h.server.budget.held == 0
    assert await h.call("greedy", "hold", b"x" * (2 * MIB)) == 2 * MIB  # given back when the calls ended
    assert h.server.budget.held == 0


async def test_past_the_node_total_large_frames_are_refused_and_small_calls_still_run(nursery):
    h = Harness(nursery, held_bytes=5 * MIB, peer_held_bytes=3 * MIB)
    hold = _Holding()
    h.server.register("hold", hold)
    nursery.start_soon(h.call, "a", "hold", b"x" * (2 * MIB))
    nursery.start_soon(h.call, "b", "hold", b"x" * (2 * MIB))
    await hold.until(2)
    with pytest.raises(ResourceExhausted, match="retry later"):
        await h.call("c", "hold", b"x" * MIB)
    nursery.start_soon(h.call, "c", "hold", b"small")
    await hold.until(3)
    hold.release.set()


async def test_a_request_over_budget_is_refused_on_its_header_without_its_body(nursery):
    h = Harness(nursery, peer_held_bytes=MIB)
    h.server.register("hold", _Holding())
    client, server = memory_call_stream_pair()
    nursery.start_soon(h.server.serve_call, server, "p")
    header, _ = frame_parts(P.request_frame("hold", None, P.UNARY, b"x" * (2 * MIB)), MAX)
    await client.send_all(header)  # the body never comes
    with trio.fail_after(5), pytest.raises(ResourceExhausted, match="share"):
        await Framed(client, MAX).read_answer("no answer")


class _NeverRead(MemoryCallStream):
    """A server-side stream whose peer never reads: a large write waits forever."""

    async def send_all(self, data: bytes, eof: bool = False) -> None:
        if len(data) >= 64 << 10:
            await trio.sleep_forever()
        await super().send_all(data, eof)


def _never_read_pair():
    a, b = MemoryCallStream(), _NeverRead()
    a.peer, b.peer = b, a
    return a, b


async def test_answers_nobody_reads_stay_counted_until_the_call_ends(nursery):
    h = Harness(nursery, peer_held_bytes=3 * MIB)

    async def big(arg, ctx):
        return b"z" * MIB

    h.server.register("big", big)
    async with trio.open_nursery() as callers:
        for _ in range(2):
            callers.start_soon(unary_call, h.opener("slow", _never_read_pair), "big", None, None, MAX)
        await trio.testing.wait_all_tasks_blocked()
        assert 2 * MIB < h.server.budget.of("slow") < 3 * MIB  # two answers, waiting to be sent
        with pytest.raises(ResourceExhausted, match="share"):  # a third answer would pass the share
            await unary_call(h.opener("slow", _never_read_pair), "big", None, 5.0, MAX)
        assert 2 * MIB < h.server.budget.of("slow") < 3 * MIB
        callers.cancel_scope.cancel()


async def test_client_stream_items_count_only_while_they_arrive(nursery):
    h = Harness(nursery, peer_held_bytes=2 * MIB)

    async def total(items, ctx):
        return sum([len(x) async for x in items])

    h.server.register("total", total, kind="client_stream")
    items = [b"i" * MIB for _ in range(5)]  # 5 MiB in all, past a 2 MiB share, one at a time
    assert await client_stream_call(h.opener("p"), "total", items, 5.0, MAX) == 5 * MIB
    assert h.server.budget.held == 0
