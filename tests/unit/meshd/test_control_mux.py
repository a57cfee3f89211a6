"""The control socket's stream multiplexer, without sockets: frames, windows, limits,
and what malformed input costs the sender (its stream or its connection)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.control.mux import CREDIT, DATA, END, HEADER, RESET, Mux, MuxError


def pair(**limits):
    return Mux(client=True, **limits), Mux(client=False, **limits)


def deliver(src: Mux, dst: Mux):
    return dst.receive_data(src.data_to_send())


def frame(stream_id: int, kind: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(stream_id, kind, len(payload)) + payload


def test_streams_carry_their_own_bytes_and_ends_both_ways():
    client, server = pair()
    a, b = client.open(), client.open()
    client.send(a, b"request a", end=True)
    client.send(b, b"request b")
    sa, sb = deliver(client, server)
    assert (sa.id, sb.id) == (a.id, b.id)
    assert server.read(sa, 100) == b"request a" and sa.ended_in
    assert server.read(sb, 100) == b"request b" and not sb.ended_in
    server.send(sb, b"reply b", end=True)
    assert deliver(server, client) == []
    assert client.read(b, 100) == b"reply b" and b.ended_in
    assert client.read(b, 100) == b""


def test_a_sender_stops_at_the_window_and_reading_half_of_it_gives_credit():
    client, server = pair(window=1000, max_chunk=300)
    stream = client.open()
    assert client.send(stream, b"x" * 1500) == 1000
    assert client.send(stream, b"y") == 0
    [peer] = deliver(client, server)
    assert server.read(peer, 400) == b"x" * 400
    deliver(server, client)
    assert stream.send_window == 0  # under half a window read: no credit yet
    server.read(peer, 200)
    deliver(server, client)
    assert stream.send_window == 600


def test_data_beyond_the_window_costs_the_connection():
    client, server = pair(window=100, max_chunk=100)
    with pytest.raises(MuxError, match="beyond its window"):
        server.receive_data(frame(1, DATA, b"x" * 100) + frame(1, DATA, b"y"))


@pytest.mark.parametrize("data, message", [
    (HEADER.pack(1, DATA, 1 << 30), "carries 1 to"),  # refused from the header alone
    (frame(1, DATA, b""), "carries 1 to"),
    (frame(1, 9), "unknown frame type"),
    (frame(1, END, b"x"), "carry nothing"),
    (frame(1, CREDIT, b"xy"), "carries 4 bytes"),
    (frame(1, CREDIT, b"\0\0\0\1"), "never opened"),
    (frame(1, DATA, b"a") + frame(1, END) + frame(1, DATA, b"b"), "after its END"),
])
def test_malformed_frames_cost_the_connection(data, message):
    server = Mux(client=False)
    with pytest.raises(MuxError, match=message):
        server.receive_data(data)


def test_the_server_cannot_open_streams():
    with pytest.raises(MuxError, match="server opened"):
        Mux(client=True).receive_data(frame(1, DATA, b"x"))


def test_a_stream_over_the_limit_is_reset_and_costs_only_itself():
    client, server = pair(max_streams=2)
    server.receive_data(frame(1, DATA, b"a") + frame(2, DATA, b"b"))
    assert server.receive_data(frame(3, DATA, b"c")) == []
    assert server.data_to_send() == frame(3, RESET)
    assert server.receive_data(frame(3, DATA, b"more")) == []  # a gone stream's frames are dropped
    assert sorted(server.streams) == [1, 2]


def test_a_client_waits_for_a_free_stream_at_the_limit():
    client, server = pair(max_streams=1)
    stream = client.open()
    assert not client.can_open()
    with pytest.raises(MuxError):
        client.open()
    client.reset(stream)
    assert client.can_open()


def test_a_reset_ends_the_stream_at_both_ends():
    client, server = pair()
    stream = client.open()
    client.send(stream, b"request")
    [peer] = deliver(client, server)
    client.reset(stream)
    deliver(client, server)
    assert peer.reset and peer.readable and not server.streams
    assert server.send(peer, b"late reply") == 0


def test_a_stream_abandoned_before_its_first_byte_is_no_error():
    client, server = pair()
    client.reset(client.open())
    assert deliver(client, server) == [] and not server.streams
    stream = client.open()
    client.send(stream, b"next")
    assert [s.id for s in deliver(client, server)] == [2]


def test_closing_stops_reading_and_credits_what_arrives_after():
    client, server = pair(window=100, max_chunk=100)
    stream = client.open()
    client.send(stream, b"x" * 100)
    [peer] = deliver(client, server)
    server.close(peer)
    deliver(server, client)
    assert stream.ended_in and stream.send_window == 100
    client.send(stream, b"y" * 100)
    deliver(client, server)
    assert not peer.inbox


def test_a_stream_is_forgotten_once_both_sides_ended():
    client, server = pair()
    stream = client.open()
    client.send(stream, b"request", end=True)
    [peer] = deliver(client, server)
    server.send(peer, b"reply", end=True)
    assert not server.streams
    deliver(server, client)
    assert not client.streams and client.read(stream, 100) == b"reply"


def test_a_lost_connection_resets_every_stream():
    client = Mux(client=True)
    streams = [client.open() for _ in range(3)]
    client.connection_lost()
    assert all(s.reset for s in streams) and client.can_open()


def test_frames_may_arrive_split_anywhere():
    client, server = pair()
    stream = client.open()
    client.send(stream, b"hello", end=True)
    data = client.data_to_send()
    opened = []
    for i in range(len(data)):
        opened += server.receive_data(data[i:i + 1])
    assert server.read(opened[0], 100) == b"hello" and opened[0].ended_in


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.binary(max_size=8)), max_size=12),
       st.binary(max_size=40))
def test_any_input_is_taken_or_refused_with_mux_error(frames, tail):
    server = Mux(client=False, max_streams=3, window=16, max_chunk=8)
    data = b"".join(frame(sid, kind, payload) for sid, kind, payload in frames) + tail
    try:
        server.receive_data(data)
    except MuxError:
        return
    assert len(server.streams) <= 3
    assert all(len(s.inbox) <= 16 for s in server.streams.values())
