"""The QUIC transport between two endpoints in one process, on loopback."""

import socket

import pytest
import trio
import trio.testing

from meshd.identity import Identity
from meshd.rpc import RpcServer, client_stream_call, unary_call
from meshd.streams import StreamAborted, StreamRefused
from meshd.transport import DialError, Endpoint, TransportConfig
from meshd.transport.stream import SEND_HIGH_WATER

from blocking import BlockingHandler

MAX = 16 << 20


class Side:
    """An endpoint that serves RPC on every incoming stream."""

    def __init__(self, nursery, config=None):
        self.identity = Identity.generate()
        self.server = RpcServer(max_frame=MAX)
        self.connections = []
        self.lost = []
        self.nursery = nursery
        self.endpoint = Endpoint(self.identity, config or TransportConfig(),
                                 on_connection=self._on_connection,
                                 on_connection_lost=self.lost.append)

    def _on_connection(self, conn):
        self.connections.append(conn)
        conn.on_stream = lambda c, s: self.nursery.start_soon(self.server.serve_call, s, c.peer_id)

    async def start(self):
        self.addr = await self.nursery.start(self.endpoint.serve, "127.0.0.1", 0)
        return self


@pytest.fixture
async def pair(nursery):
    a, b = await Side(nursery).start(), await Side(nursery).start()

    async def echo(arg, ctx):
        return arg

    a.server.register("echo", echo)
    b.server.register("echo", echo)
    return a, b


async def test_both_sides_prove_their_keys(pair):
    a, b = pair
    conn = await b.endpoint.dial(*a.addr, a.identity.peer_id)
    assert conn.peer_id == a.identity.peer_id
    with trio.fail_after(5):
        while not a.connections:
            await trio.testing.wait_all_tasks_blocked()
    assert a.connections[0].peer_id == b.identity.peer_id


async def test_dialing_the_wrong_key_fails_clearly(pair):
    a, b = pair
    stranger = Identity.generate().peer_id
    with pytest.raises(DialError, match=f"dialed {stranger} but the node there is {a.identity.peer_id}"):
        await b.endpoint.dial(*a.addr, stranger)
    conn = await b.endpoint.dial(*a.addr, a.identity.peer_id)  # a still serves
    assert await unary_call(lambda: _ready(conn.open_stream()), "echo", 1, 5, MAX) == 1


async def test_dial_to_nothing_times_out_with_a_reason(nursery):
    b = await Side(nursery, TransportConfig(handshake_timeout=0.3)).start()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))
        with pytest.raises(DialError, match="no answer within 0.3 s"):
            await b.endpoint.dial(*silent.getsockname(), Identity.generate().peer_id)


async def _ready(value):
    return value


async def test_many_concurrent_calls_share_one_connection(pair):
    a, b = pair
    conn = await b.endpoint.dial(*a.addr, a.identity.peer_id)
    results = {}

    async def one(i):
        results[i] = await unary_call(lambda: _ready(conn.open_stream()), "echo", i, 10, MAX)

    async with trio.open_nursery() as nursery:
        for i in range(300):
            nursery.start_soon(one, i)
    assert results == {i: i for i in range(300)}
    assert b.endpoint.connection_count == 1


async def test_a_lone_call_flushes_each_side_once_its_ack_riding_on_the_reply(pair):
    """Neither side flushes right after a datagram of a lone call arrives (with
    ACKs riding on data that flush finds nothing to send): the handler's reply,
    and the caller's next request, carry the ACK."""
    a, b = pair
    conn = await b.endpoint.dial(*a.addr, a.identity.peer_id)
    call = lambda: unary_call(lambda: _ready(conn.open_stream()), "echo", b"x" * 128, 5, MAX)  # noqa: E731
    for _ in range(5):  # the handshake's and identify's packets settle
        await call()
    before = a.endpoint.stats["idle_flushes"], b.endpoint.stats["idle_flushes"]
    for _ in range(40):
        assert await call() == b"x" * 128
    after = a.endpoint.stats["idle_flushes"], b.endpoint.stats["idle_flushes"]
    assert after[0] - before[0] <= 4 and after[1] - before[1] <= 4, (before, after)


async def test_a_stream_whose_first_bytes_come_after_a_later_streams_is_served(pair):
    """Streams are numbered as they are opened, but a caller may write a later one first
    (its task got there first); the peer then hears stream 4 before stream 0.  Opening 4
    opened 0 too (RFC 9000 section 3.2), so 0's call is served when its bytes come.  (They
    were dropped as "not a new stream": the call waited out its deadline, as the learning
    lane's token calls did, 10 s each, when a member fetched several slices at once.)"""
    a, b = pair
    conn = await b.endpoint.dial(*a.addr, a.identity.peer_id)
    first, second = conn.open_stream(), conn.open_stream()
    assert first.stream_id < second.stream_id
    with trio.fail_after(5):
        assert await unary_call(lambda: _ready(second), "echo", "second", 10, MAX) == "second"
        assert await unary_call(lambda: _ready(first), "echo", "first", 10, MAX) == "first"


async def test_a_replaced_connection_refuses_a_stream_it_knew_of_only_by_a_later_ones_number(pair):
    """Stream 4 reached the peer before stream 0 wrote anything; the peer then closes the
    connection as replaced.  Stream 0 was never seen there, so it fails as refused (the
    caller may send it again), not as lost with its request perhaps acted on.  (The close
    named only the last stream seen, 4, so 0 failed as UNAVAILABLE.)"""
    a, b = pair
    conn = await b.endpoint.dial(*a.addr, a.identity.peer_id)
    first, second = conn.open_stream(), conn.open_stream()
    with trio.fail_after(5):
        assert await unary_call(lambda: _ready(second), "echo", "second", 10, MAX) == "second"
        [served] = a.connections
        served.close_replaced()
        await conn.terminated.wait()
    with pytest.raises(StreamRefused):
        await first.send_all(b"x")


async def test_a_reader_that_stops_reading_stops_the_writer(nursery):
    cfg = TransportConfig(stream_window=256 << 10, connection_window=1 << 20)
    a, b = await Side(nursery, cfg).start(), await Side(nursery, cfg).start()
    gate = trio.Event()
    received = 0

    async def slow_sink(items, ctx):
        nonlocal received
        await gate.wait()
        async for item in items:
            received += len(item)
        return received

    a.server.register("sink", slow_sink, kind="client_stream")
    conn = await b.endpoint.dial(*a.addr, a.identity.peer_id)
    sent = 0
    chunk = b"x" * (64 << 10)

    def items():
        nonlocal sent
        for _ in range(256):  # 16 MiB offered
            sent += len(chunk)
            yield chunk

    result = {}

    async def send():
        result["n"] = await client_stream_call(lambda: _ready(conn.open_stream()), "sink", items(), 60, MAX)

    nursery.start_soon(send)
    await trio.testing.wait_all_tasks_blocked(cushion=0.2)
    # The writer is stuck.  What it got out is bounded by the stream window, its own
    # send buffer, and what the server took with its one read (the request frame's
    # read returns what had arrived, up to a window): 1.6 MiB of the 16 MiB offered.
    assert sent <= 2 * cfg.stream_window + SEND_HIGH_WATER + 2 * len(chunk)
    gate.set()
    with trio.fail_after(30):
        while "n" not in result:
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
    assert sent == 256 * len(chunk)


async def test_garbage_and_stun_datagrams_are_sorted_out(pair):
    a, b = pair
    stun = []
    a.endpoint.stun_hook = lambda data, addr: stun.append(data)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(b"\x00\x01\x00\x00\x21\x12\xa4\x42" + b"\x00" * 12, a.addr)  # STUN binding request
        for junk in (b"\x40", b"\xc0\x00", b"\xff" * 1500, b"hello", b"\x80" * 40):
            s.sendto(junk, a.addr)
    conn = await b.endpoint.dial(*a.addr, a.identity.peer_id)
    assert await unary_call(lambda: _ready(conn.open_stream()), "echo", "ok", 5, MAX) == "ok"
    assert len(stun) == 1 and stun[0][:2] == b"\x00\x01"
    dropped = a.endpoint.stats["garbage"] + a.endpoint.stats["unroutable"]
    assert dropped == 5


async def test_close_fails_open_streams_and_tells_the_peer(pair):
    a, b = pair
    hang = BlockingHandler()
    a.server.register("hang", hang)
    conn = await b.endpoint.dial(*a.addr, a.identity.peer_id)
    stream = conn.open_stream()

    async def call():
        with pytest.raises(Exception) as info:
            await unary_call(lambda: _ready(stream), "hang", None, 10, MAX)
        return info

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        await hang.started.wait()
        conn.close(reason="test over")
    with trio.fail_after(5):
        while not a.lost:
            await trio.testing.wait_all_tasks_blocked(cushion=0.02)
    assert a.lost[0].close_reason == "test over"
    with pytest.raises(StreamAborted):
        conn.open_stream()


async def test_caller_giving_up_cancels_the_remote_handler(pair):
    a, b = pair
    hang = BlockingHandler()
    a.server.register("hang", hang)
    conn = await b.endpoint.dial(*a.addr, a.identity.peer_id)
    async with trio.open_nursery() as nursery:  # no deadline: only the reset can stop it
        nursery.start_soon(unary_call, lambda: _ready(conn.open_stream()), "hang", None, None, MAX)
        await hang.started.wait()
        nursery.cancel_scope.cancel()
    with trio.fail_after(5):
        await hang.cancelled.wait()  # STOP_SENDING / RESET_STREAM reached the server
    assert await unary_call(lambda: _ready(conn.open_stream()), "echo", 1, 5, MAX) == 1


@pytest.mark.parametrize("target", ["127.0.0.1", "::1"])
async def test_one_dual_stack_socket_takes_ipv4_and_ipv6(nursery, target):
    a = Side(nursery)
    a.addr = await nursery.start(a.endpoint.serve, "::", 0)
    b = Side(nursery)
    await nursery.start(b.endpoint.serve, "::", 0)

    async def echo(arg, ctx):
        return arg

    a.server.register("echo", echo)
    conn = await b.endpoint.dial(target, a.addr[1], a.identity.peer_id)
    assert await unary_call(lambda: _ready(conn.open_stream()), "echo", target, 5, MAX) == target


async def test_an_ipv4_socket_refuses_ipv6_targets_clearly(pair):
    a, b = pair
    with pytest.raises(DialError, match="IPv6 but this node listens on IPv4 only"):
        await b.endpoint.dial("::1", a.addr[1], a.identity.peer_id)


async def test_a_sender_aioquic_reset_unseen_fails_as_an_aborted_stream(pair):
    # aioquic resets a sender itself on STOP_SENDING; a write that races the
    # event must fail the stream (StreamAborted), not raise RuntimeError into the node.
    a, b = pair
    conn = await b.endpoint.dial(*a.addr, a.identity.peer_id)
    stream = conn.open_stream()
    await stream.send_all(b"x")
    conn.quic._streams[stream.stream_id].sender.reset(error_code=0)
    with pytest.raises(StreamAborted):
        await stream.send_all(b"more")
    await stream.close()  # closing an already stopped stream is quiet
    assert await unary_call(lambda: _ready(conn.open_stream()), "echo", 2, 5, MAX) == 2


# --- path MTU discovery (meshd/transport/pmtu.py; docs/transport.md "Datagram size") ---

PROBED = TransportConfig(loopback_datagram_size=0, pmtud_max_datagram_size=9000)  # loopback probed like any path


async def probed_pair(nursery, config=PROBED):
    a, b = await Side(nursery, config).start(), await Side(nursery, config).start()

    async def sink(items, ctx):
        total = 0
        async for item in items:
            total += len(item)
        return total

    a.server.register("sink", sink, kind="client_stream")
    conn = await b.endpoint.dial(*a.addr, a.identity.peer_id)
    return a, b, conn


async def settled(side) -> None:
    with trio.fail_after(5):
        while not side.endpoint.stats["pmtu_searches_done"]:
            await trio.sleep(0.01)


async def test_path_mtu_discovery_raises_the_datagram_size_over_a_real_socket(nursery):
    a, b, conn = await probed_pair(nursery)
    await settled(b)
    await settled(a)
    assert conn.datagram_size == 9000 and a.connections[0].datagram_size == 9000
    assert b.endpoint.stats["pmtu_probes"] == b.endpoint.stats["pmtu_raised"]  # none lost
    chunks = (b"x" * (1 << 20) for _ in range(8))
    assert await client_stream_call(lambda: _ready(conn.open_stream()), "sink", chunks, 30, MAX) == 8 << 20


async def test_a_black_hole_on_the_path_drops_the_size_and_calls_go_on(nursery):
    a, b, conn = await probed_pair(nursery)
    await settled(b)
    assert conn.datagram_size == 9000
    for side in (a, b):  # from now on the path silently drops datagrams above 1300 bytes
        real = side.endpoint.send_datagram
        side.endpoint.send_datagram = lambda data, addr, real=real: len(data) > 1300 or real(data, addr)
    chunks = (b"x" * (1 << 20) for _ in range(8))
    with trio.fail_after(20):
        got = await client_stream_call(lambda: _ready(conn.open_stream()), "sink", chunks, 20, MAX)
    assert got == 8 << 20
    assert b.endpoint.stats["pmtu_black_holes"] >= 1
    with trio.fail_after(10):
        while conn.quic.pmtu.state.value != "search_complete":
            await trio.sleep(0.01)
    assert 1200 < conn.datagram_size <= 1300


async def test_with_pmtud_off_a_path_keeps_1200_byte_datagrams(nursery):
    config = TransportConfig(loopback_datagram_size=0, pmtud=False)
    a, b, conn = await probed_pair(nursery, config)
    chunks = (b"x" * (1 << 20) for _ in range(2))
    assert await client_stream_call(lambda: _ready(conn.open_stream()), "sink", chunks, 30, MAX) == 2 << 20
    assert conn.datagram_size == 1200 and conn.quic.pmtu is None
    assert b.endpoint.stats["pmtu_probes"] == 0


async def test_loopback_keeps_its_fixed_datagram_size_and_is_not_probed(pair):
    a, b = pair
    conn = await b.endpoint.dial(*a.addr, a.identity.peer_id)
    assert await unary_call(lambda: _ready(conn.open_stream()), "echo", 1, 5, MAX) == 1
    assert conn.datagram_size == TransportConfig().loopback_datagram_size and conn.quic.pmtu is None


async def test_over_its_handshake_limit_a_server_makes_dialers_prove_their_address_with_retry(nursery):
    a = await Side(nursery, TransportConfig(retry_above=0)).start()  # every new Initial gets a Retry
    b = await Side(nursery).start()

    async def echo(arg, ctx):
        return arg

    a.server.register("echo", echo)
    conn = await b.endpoint.dial(*a.addr, a.identity.peer_id)
    assert await unary_call(lambda: _ready(conn.open_stream()), "echo", "ok", 5, MAX) == "ok"
    assert a.endpoint.stats["retry_sent"] == 1  # one round trip, then the handshake with the token


async def test_an_initial_with_a_forged_token_gets_no_connection(nursery):
    from aioquic.quic.configuration import QuicConfiguration
    from aioquic.quic.connection import QuicConnection

    a = await Side(nursery, TransportConfig(retry_above=0)).start()
    client = QuicConnection(configuration=QuicConfiguration(is_client=True, alpn_protocols=["meshd/1"]))
    client._peer_token = b"\x00" * 40  # a token the server never issued
    client.connect(a.addr, now=trio.current_time())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for datagram, _ in client.datagrams_to_send(trio.current_time()):
            s.sendto(datagram, a.addr)
        await trio.testing.wait_all_tasks_blocked()  # (the datagrams are in a's socket already)
    assert a.endpoint.stats["bad_token"] == 1
    assert a.connections == [] and a.endpoint.stats["retry_sent"] == 0


async def test_version_negotiation_answers_only_datagrams_of_a_full_initials_size(pair):
    a, _ = pair
    unknown_version = b"\xc0\x0a\x0a\x0a\x0a\x08" + b"\x01" * 8 + b"\x08" + b"\x02" * 8
    with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        await s.bind(("127.0.0.1", 0))
        await s.sendto(unknown_version + b"\x00" * 40, a.addr)  # small: no answer (RFC 9000 section 6.1)
        await s.sendto(unknown_version + b"\x00" * 1200, a.addr)
        with trio.fail_after(5):
            reply = await s.recv(2048)
    assert reply[1:5] == b"\x00\x00\x00\x00"  # a Version Negotiation packet, for the big one only
    assert a.endpoint.stats["unroutable"] == 1


async def two_peers_and_a_recorder(nursery, monkeypatch, config=None):
    """``a`` (with ``config``) connected to two peers; the connection IDs each uses to reach
    ``a``, and a list of the tagged datagrams ``a`` processes, in order."""
    a = await Side(nursery, config).start()
    peers = [await Side(nursery).start() for _ in range(2)]
    for peer in peers:
        await peer.endpoint.dial(*a.addr, a.identity.peer_id)
    with trio.fail_after(5):
        while len(a.connections) < 2:
            await trio.testing.wait_all_tasks_blocked()
    processed = []
    original = a.endpoint._datagram_received

    def recording(data, addr, now):
        if data[9:12] == b"TAG":
            processed.append(data[12:16])
        return original(data, addr, now)

    monkeypatch.setattr(a.endpoint, "_datagram_received", recording)
    return a, [conn.quic.host_cid for conn in a.connections], processed


def tagged(cid: bytes, tag: bytes, size: int = 100) -> bytes:
    """A short-header datagram to connection ID ``cid`` that no key decrypts (QUIC drops it)."""
    return (b"\x40" + cid + b"TAG" + tag).ljust(size, b"\x00")


async def test_a_connections_datagram_waits_behind_one_of_each_other_connection_not_their_backlog(
        nursery, monkeypatch):
    a, (busy, quiet), processed = await two_peers_and_a_recorder(nursery, monkeypatch)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for i in range(200):  # all in a's socket before its receive loop runs again
            s.sendto(tagged(busy, b"%04d" % i), a.addr)
        s.sendto(tagged(quiet, b"late"), a.addr)
    with trio.fail_after(5):
        while len(processed) < 201:
            await trio.testing.wait_all_tasks_blocked()
    assert processed.index(b"late") <= 1  # read first-come first-served it would be the 201st
    assert [tag for tag in processed if tag != b"late"] == [b"%04d" % i for i in range(200)]


async def test_past_recv_queue_the_busiest_connection_loses_datagrams_and_the_others_none(
        nursery, monkeypatch):
    config = TransportConfig(recv_queue=64 << 10)
    a, (busy, quiet), processed = await two_peers_and_a_recorder(nursery, monkeypatch, config)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for i in range(200):  # 200 KB in a's socket: three times what its inbox holds
            s.sendto(tagged(busy, b"%04d" % i, 1000), a.addr)
        s.sendto(tagged(quiet, b"late", 1000), a.addr)
    with trio.fail_after(5):
        while b"late" not in processed:
            await trio.testing.wait_all_tasks_blocked()
        await trio.testing.wait_all_tasks_blocked()
    dropped = a.endpoint.stats["recv_dropped"]
    assert dropped >= 200 - 65 and len(processed) - 1 + dropped == 200
    assert [tag for tag in processed if tag != b"late"] == [b"%04d" % i for i in range(200 - dropped)]


async def test_a_burst_of_new_handshakes_is_served_one_per_round_after_known_connections(
        nursery, monkeypatch):
    """Each new handshake costs the node milliseconds of one thread: a peer's datagram
    that comes after a burst of Initials waits behind one of them, not all."""
    from aioquic.quic.configuration import QuicConfiguration
    from aioquic.quic.connection import QuicConnection

    a, (known, _), processed = await two_peers_and_a_recorder(nursery, monkeypatch)
    accept = a.endpoint._accept

    def recording_accept(data, header, addr):
        processed.append(b"new")
        return accept(data, header, addr)

    monkeypatch.setattr(a.endpoint, "_accept", recording_accept)
    burst = 6  # fewer than retry_above: each is a whole handshake
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(burst):  # all in a's socket before its receive loop runs again
            client = QuicConnection(configuration=QuicConfiguration(is_client=True, alpn_protocols=["meshd/1"]))
            client.connect(a.addr, now=trio.current_time())
            s.sendto(client.datagrams_to_send(trio.current_time())[0][0], a.addr)
        s.sendto(tagged(known, b"late"), a.addr)
        with trio.fail_after(5):
            while processed.count(b"new") < burst or b"late" not in processed:
                await trio.testing.wait_all_tasks_blocked()
    assert processed.index(b"late") <= 1, processed  # first-come first-served it would be the 7th
    assert a.endpoint._handshakes() == burst  # every one was served in the end
