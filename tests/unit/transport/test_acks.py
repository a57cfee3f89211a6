"""When MeshQuicConnection acknowledges: after every second packet received, with
the data it sends next if no ACK left within the ACK delay, or alone once the delay
has passed (in-memory link)."""

from aioquic.tls import Epoch

from meshd.transport.quic import ACK_DELAY
from test_pmtu_quic import CLIENT, SERVER, Link


def quiet_link() -> Link:
    link = Link(mtu=1472, max_size=1472, server_probes=False)
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


def test_calls_in_a_row_go_one_datagram_each_way_every_second_one_carrying_an_ack():
    link = quiet_link()
    sent = {name: len(datagrams) for name, datagrams in link.sent.items()}
    acks = calls(link, 40)  # a call every 0.2 ms: no ACK waits for its delay, none goes alone
    assert {name: len(link.sent[name]) - sent[name] for name in sent} == {"client": 40, "server": 40}
    assert 19 <= acks["client"] <= 21 and 19 <= acks["server"] <= 21
    assert link.client._spaces[Epoch.ONE_RTT].ack_at is not None  # the last reply's ACK waits for the next call...
    link.step(ACK_DELAY)
    assert len(link.sent["client"]) - sent["client"] == 41  # ...or its delay, then goes alone


def test_a_lone_call_s_reply_carries_the_ack_of_its_request():
    link = quiet_link()
    sent = len(link.sent["server"])
    assert calls(link, 1) == {"client": 0, "server": 1}
    assert len(link.sent["server"]) - sent == 1


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
