"""When MeshQuicConnection acknowledges: at once after two full-size packets' worth
of bytes, a PING, or while a stream of ours waits for stream credit; with the data it
sends next if no ACK left within ACK_RIDE_GAP; or alone ACK_DELAY after it could have
ridden (in-memory link)."""

from functools import partial

from aioquic.quic import events as ev
from aioquic.tls import Epoch

from meshd.transport.quic import ACK_DELAY, ACK_RIDE_GAP, MeshQuicConnection
from test_pmtu_quic import CLIENT, SERVER, Link


def quiet_link(**server) -> Link:
    """A link past its handshake and path-MTU search; ``server``: MeshQuicConnection's arguments."""
    link = Link(mtu=1472, max_size=1472, server_probes=False,
                server_class=partial(MeshQuicConnection, **server))
    link.settle()
    for _ in range(20):  # the handshake's and the search's last ACKs
        link.step(ACK_DELAY)
    return link


def send(link: Link, name: str) -> bool:
    """``name`` sends what it has, 0.1 ms on; whether that carried an ACK."""
    conn, peer = (link.client, link.server) if name == "client" else (link.server, link.client)
    space = conn._spaces[Epoch.ONE_RTT]
    pending = space.ack_at is not None
    link.now += 0.0001
    link._carry(name, conn, peer, CLIENT if name == "client" else SERVER)
    return pending and space.ack_at is None


def calls(link: Link, count: int) -> dict[str, int]:
    """``count`` calls one after the other, each side writing (the reply, the next
    request) before it sends, as a node's receive loop lets it: ACKs sent, by side."""
    acks = {"client": 0, "server": 0}
    for _ in range(count):
        stream = link.client.get_next_available_stream_id()
        link.client.send_stream_data(stream, b"q" * 128, end_stream=True)
        acks["client"] += send(link, "client")
        link.server.send_stream_data(stream, b"r" * 128, end_stream=True)
        acks["server"] += send(link, "server")
    return acks


def test_calls_in_a_row_go_one_datagram_each_way_an_ack_riding_on_one_every_ride_gap():
    link = quiet_link()
    sent = {name: len(datagrams) for name, datagrams in link.sent.items()}
    acks = calls(link, 60)  # a call every 0.2 ms: each ACK rides before its timer, none goes alone
    assert {name: len(link.sent[name]) - sent[name] for name in sent} == {"client": 60, "server": 60}
    rides = round(60 * 0.0002 / ACK_RIDE_GAP)  # every second packet, as before, would be 30
    assert rides - 1 <= acks["client"] <= rides + 1 and rides - 1 <= acks["server"] <= rides + 1
    assert link.client._spaces[Epoch.ONE_RTT].ack_at is not None  # the last reply's ACK waits for the next call...
    link.step(ACK_RIDE_GAP + ACK_DELAY)
    assert len(link.sent["client"]) - sent["client"] == 61  # ...or its delay, then goes alone


def test_a_lone_call_s_reply_carries_the_ack_of_its_request():
    link = quiet_link()
    sent = len(link.sent["server"])
    assert calls(link, 1) == {"client": 0, "server": 1}
    assert len(link.sent["server"]) - sent == 1


def test_a_lone_call_s_reply_is_acknowledged_alone_after_the_ack_delay():
    link = quiet_link()
    calls(link, 1)
    sent = len(link.sent["client"])
    link.step(ACK_DELAY / 2)
    assert len(link.sent["client"]) == sent  # still waiting for a next call to ride on
    link.step(ACK_DELAY)  # our last ACK was long ago: it may ride at once, so its delay counts from now
    assert len(link.sent["client"]) - sent == 1
    assert 1.5 * ACK_DELAY < ACK_RIDE_GAP  # while both ends are still warm, not a 20 ms timer later


def test_a_bulk_receiver_acknowledges_every_second_packet_at_once():
    link = quiet_link()
    link.client.send_stream_data(link.client.get_next_available_stream_id(), b"x" * (1 << 20), end_stream=True)
    steps = 0
    while link.received < 1 << 20:
        before = {name: len(datagrams) for name, datagrams in link.sent.items()}
        link.step(0.0001)  # the client's packets reach the server, then the server's leave
        steps += 1
        assert steps < 2000
        received = len(link.sent["client"]) - before["client"]
        if received >= 2:  # an ACK of them left in the same step, not a millisecond later
            assert len(link.sent["server"]) > before["server"]


def test_with_acks_at_once_the_server_acknowledges_each_request_before_its_reply():
    link = quiet_link()
    for conn in (link.client, link.server):
        conn.ack_at_once()
    sent = {name: len(datagrams) for name, datagrams in link.sent.items()}
    for _ in range(10):
        stream = link.client.get_next_available_stream_id()
        link.client.send_stream_data(stream, b"q" * 128, end_stream=True)
        link.step(0.0001)  # the request arrives and is acknowledged at once, alone
        link.server.send_stream_data(stream, b"r" * 128, end_stream=True)
        link.step(0.0001)
    # the server: an ACK alone, then the reply (the client's ACK of a reply leaves with the
    # next request here, as this link lets each side send once per step)
    assert len(link.sent["server"]) - sent["server"] == 20


def test_a_ping_is_acknowledged_at_once():
    link = quiet_link()
    sent = len(link.sent["server"])
    link.client.send_ping(1)
    link.step(0.0001)  # the PING arrives, and its ACK leaves in the same step, alone
    assert len(link.sent["server"]) - sent == 1
    assert link.server._spaces[Epoch.ONE_RTT].ack_at is None


def test_a_side_waiting_for_streams_acknowledges_at_once_so_the_peer_frees_them():
    link = quiet_link(max_streams=2)  # the client may have 2 streams open at once
    streams = []
    for _ in range(3):  # the third waits for the server to allow it
        streams.append(link.client.get_next_available_stream_id())
        link.client.send_stream_data(streams[-1], b"q" * 128, end_stream=True)
    link.step(0.0001)
    asked = [e.stream_id for e in link.events["server"] if isinstance(e, ev.StreamDataReceived)]
    assert asked == streams[:2]
    for stream in asked:
        link.server.send_stream_data(stream, b"r" * 128, end_stream=True)
    for _ in range(3):  # the replies, the client's ACK of them, the server's MAX_STREAMS
        link.step(0.0001)  # 0.3 ms: far less than the ACK_RIDE_GAP a pending ACK waits for
    asked = [e.stream_id for e in link.events["server"] if isinstance(e, ev.StreamDataReceived)]
    assert asked == streams
