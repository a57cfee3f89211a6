"""When MeshQuicConnection acknowledges: with the data it sends next, after every
second packet received, or alone once the ACK delay has passed (in-memory link)."""

from aioquic.tls import Epoch

from meshd.transport.quic import ACK_DELAY
from test_pmtu_quic import Link


def quiet_link() -> Link:
    link = Link(mtu=1472, max_size=1472, server_probes=False)
    link.settle()
    for _ in range(20):  # the handshake's and the search's last ACKs
        link.step(ACK_DELAY)
    return link


def test_a_request_and_its_reply_each_carry_the_others_ack_one_datagram_each_way():
    link = quiet_link()
    sent = {name: len(datagrams) for name, datagrams in link.sent.items()}
    calls = 40
    for _ in range(calls):  # a call every 0.2 ms: its ACKs must not wait for their delay
        stream = link.client.get_next_available_stream_id()
        link.client.send_stream_data(stream, b"q" * 128, end_stream=True)
        link.step(0.0001)
        link.server.send_stream_data(stream, b"r" * 128, end_stream=True)
        link.step(0.0001)
    assert {name: len(link.sent[name]) - sent[name] for name in sent} == {"client": calls, "server": calls}
    assert link.client._spaces[Epoch.ONE_RTT].ack_at is not None  # the last reply's ACK waits for the next call...
    link.step(ACK_DELAY)
    assert len(link.sent["client"]) - sent["client"] == calls + 1  # ...or its delay, then goes alone


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
