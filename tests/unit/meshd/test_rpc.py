"""The RPC layer over an in-memory stream pair: call kinds, errors, deadlines, cancellation."""


import pytest
import trio
from hypothesis import given, settings, strategies as st

from meshd.rpc import (
    DeadlineExceeded,
    FrameTooLargeError,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    ResponseStream,
    RpcServer,
    Unavailable,
    UnknownMethod,
    bidi_call,
    client_stream_call,
    unary_call,
)
from meshd.rpc.framed import Framed
from blocking import BlockingHandler
from memstream import memory_call_stream_pair
from settle import settle

MAX = 1 << 20


class Harness:
    """An RpcServer plus a client-side stream opener that serves each call in a nursery."""

    def __init__(self, nursery, **server_args):
        self.server = RpcServer(max_frame=MAX, **server_args)
        self.nursery = nursery

    async def open(self):
        client, server = memory_call_stream_pair()
        self.nursery.start_soon(self.server.serve_call, server, "peer-1")
        return client

    async def call(self, method, arg=None, timeout=5.0):
        return await unary_call(self.open, method, arg, timeout, MAX)


@pytest.fixture
async def rpc(nursery):
    h = Harness(nursery, max_calls_per_peer=4)

    async def echo(arg, ctx):
        return arg

    async def count(n, ctx):
        for i in range(n):
            yield i

    async def total(items, ctx):
        return sum([x async for x in items])

    async def bad(arg, ctx):
        raise ValueError("secret detail")

    async def picky(arg, ctx):
        if not isinstance(arg, int):
            raise InvalidArgument("want an int")
        return arg

    h.server.register("echo", echo)
    h.server.register("count", count)
    h.server.register("total", total, kind="client_stream")
    h.server.register("bad", bad)
    h.server.register("picky", picky)
    return h


async def test_unary_server_stream_and_client_stream(rpc):
    assert await rpc.call("echo", {"x": [1, b"\x00"]}) == {"x": [1, b"\x00"]}
    assert [i async for i in ResponseStream(rpc.open, "count", 5, 5, MAX)] == [0, 1, 2, 3, 4]
    assert await client_stream_call(rpc.open, "total", range(10), 5, MAX) == 45

    async def agen():
        for i in range(3):
            yield i

    assert await client_stream_call(rpc.open, "total", agen(), 5, MAX) == 3


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.text() | st.binary(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
        max_leaves=15,
    )
)
@settings(max_examples=50, deadline=None)
def test_any_msgpack_value_round_trips(value):
    async def main():
        async with trio.open_nursery() as nursery:
            h = Harness(nursery)

            async def echo(arg, ctx):
                return arg

            h.server.register("echo", echo)
            assert await h.call("echo", value) == value

    trio.run(main)


async def test_errors_come_back_typed_and_the_server_keeps_serving(rpc):
    with pytest.raises(UnknownMethod, match="nope"):
        await rpc.call("nope")
    with pytest.raises(InvalidArgument, match="want an int"):
        await rpc.call("picky", "x")
    with pytest.raises(Internal, match="ValueError") as info:
        await rpc.call("bad")
    assert "secret detail" not in str(info.value)
    with pytest.raises(InvalidArgument, match="server_stream, called as unary"):
        await rpc.call("count", 3)
    assert await rpc.call("echo", 7) == 7


async def test_deadline_travels_with_the_request(rpc):
    seen = {}

    async def when(arg, ctx):
        seen["left"] = ctx.deadline - trio.current_time()
        return None

    rpc.server.register("when", when)
    await rpc.call("when", timeout=5)
    assert 4 < seen["left"] <= 5
    with trio.move_on_after(2):  # an enclosing deadline shorter than the timeout wins
        await rpc.call("when", timeout=30)
    assert 1 < seen["left"] <= 2
    await rpc.call("when", timeout=None)
    assert seen["left"] > 3000  # no timeout: the server's own cap applies


async def test_server_enforces_the_deadline_it_was_sent(rpc):
    stuck = BlockingHandler()
    rpc.server.register("stuck", stuck)
    client = await rpc.open()
    framed = Framed(client, MAX)
    await framed.write([0, "stuck", 50, 0, None])  # 50 ms deadline, raw
    with trio.fail_after(5):
        ok, frame = await framed.read()
        await stuck.cancelled.wait()
    assert ok and frame[:2] == [4, "DEADLINE_EXCEEDED"]


async def test_client_timeout_cancels_the_handler(rpc):
    stuck = BlockingHandler()
    rpc.server.register("stuck", stuck)
    with pytest.raises(DeadlineExceeded):
        await rpc.call("stuck", timeout=0.1)
    with trio.fail_after(5):
        await stuck.cancelled.wait()


async def test_caller_cancellation_propagates_to_the_server(rpc):
    stuck = BlockingHandler()
    rpc.server.register("stuck", stuck)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rpc.call, "stuck", None, None)
        await stuck.started.wait()
        nursery.cancel_scope.cancel()
    with trio.fail_after(5):
        await stuck.cancelled.wait()


async def test_breaking_out_of_a_stream_stops_the_generator(rpc):
    closed = trio.Event()

    async def forever(arg, ctx):
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    rpc.server.register("forever", forever)
    async with ResponseStream(rpc.open, "forever", None, None, MAX) as items:
        async for i in items:
            if i == 3:
                break
    with trio.fail_after(5):
        await closed.wait()


async def test_per_peer_concurrency_limit(rpc):
    release = trio.Event()
    entered = 0
    all_in = trio.Event()

    async def hold(arg, ctx):
        nonlocal entered
        entered += 1
        if entered == 4:
            all_in.set()
        await release.wait()
        return arg

    rpc.server.register("hold", hold)
    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(rpc.call, "hold", i)
        await all_in.wait()
        with pytest.raises(ResourceExhausted, match="4 concurrent"):
            await rpc.call("hold", 99)
        release.set()
    assert await rpc.call("hold", 5) == 5  # slots are given back


async def test_a_call_waiting_for_its_turn_ends_if_its_caller_gives_up_and_runs_when_its_turn_comes(nursery):
    h = Harness(nursery, busy_calls=1, peer_share=1)
    stuck = BlockingHandler()
    h.server.register("stuck", stuck)
    h.server.register("echo", _echo)

    def cancellable(callers, *call) -> trio.CancelScope:
        scope = trio.CancelScope()

        async def run():
            with scope:
                await h.call(*call)

        callers.start_soon(run)
        return scope

    async with trio.open_nursery() as callers:
        stuck_caller = cancellable(callers, "stuck", None, None)
        await stuck.started.wait()
        gives_up = cancellable(callers, "echo", 1, None)
        await settle(lambda: h.server.calls_waiting == 1)  # behind the stuck call: the peer runs its share
        gives_up.cancel()
        await settle(lambda: h.server.calls_waiting == 0)
        answers = []

        async def echo_two():
            answers.append(await h.call("echo", 2))

        callers.start_soon(echo_two)
        await settle(lambda: h.server.calls_waiting == 1)
        stuck_caller.cancel()  # the stuck call ends: the waiting one's turn
    assert stuck.cancelled.is_set() and answers == [2]


async def _echo(arg, ctx):
    return arg


async def test_oversized_frames_both_ways(rpc):
    with pytest.raises(FrameTooLargeError):
        await rpc.call("echo", b"x" * (MAX + 1))
    client = await rpc.open()
    await client.send_all((MAX + 1).to_bytes(4, "big"))
    with trio.fail_after(5):
        ok, frame = await Framed(client, MAX).read()
    assert frame[:2] == [4, "FRAME_TOO_LARGE"]


@pytest.mark.parametrize(
    "raw, code",
    [
        (b"\x00\x00\x00\x01\xc1", "PROTOCOL_ERROR"),  # not msgpack
        (b"\x00\x00\x00\x03\x92\x09\x09", "PROTOCOL_ERROR"),  # [9, 9]: not a request
        (b"\x00\x00\x00\x02\x91\x00", "PROTOCOL_ERROR"),  # [0]: short request
    ],
)
async def test_malformed_requests_get_error_replies(rpc, raw, code):
    client = await rpc.open()
    await client.send_all(raw)
    with trio.fail_after(5):
        ok, frame = await Framed(client, MAX).read()
    assert ok and frame[0] == 4 and frame[1] == code
    assert await rpc.call("echo", 1) == 1




async def test_bidi_calls_carry_items_both_ways_at_once(rpc):
    async def chat(channel, ctx):
        async for item in channel:
            await channel.send(item * 2)
        await channel.send("bye")

    rpc.server.register("chat", chat, kind="bidi")
    got = []
    async with bidi_call(rpc.open, "chat", None, 5, MAX) as channel:
        for i in range(5):
            await channel.send(i)
            got.append(await channel.receive())
        await channel.end()
        got.append(await channel.receive())
        with pytest.raises(trio.EndOfChannel):
            await channel.receive()
    assert got == [0, 2, 4, 6, 8, "bye"]


async def test_leaving_a_bidi_call_early_cancels_the_handler(rpc):
    stuck = BlockingHandler()
    rpc.server.register("stuck_bidi", lambda channel, ctx: stuck(None, ctx), kind="bidi")
    with pytest.raises(KeyError):
        async with bidi_call(rpc.open, "stuck_bidi", None, None, MAX):
            await stuck.started.wait()
            raise KeyError("caller gives up")
    with trio.fail_after(5):
        await stuck.cancelled.wait()


async def test_a_bidi_caller_whose_stream_is_lost_gets_unavailable_when_sending():
    """The peer died (or stopped reading) mid-call: ``send`` raises Unavailable, an
    RpcError as for every lost call, not the transport's StreamAborted, which got
    past a document sync's ``except RpcError`` and ended the daemon (the chaos soak,
    docs/soak.md)."""
    server_ends = []

    async def open_stream():
        client, server = memory_call_stream_pair()
        server_ends.append(server)
        return client

    with pytest.raises(Unavailable, match="connection lost"):
        async with bidi_call(open_stream, "sync", None, 5, MAX) as channel:
            server_ends[0].abort()
            await channel.send("item")
