"""The stateless refusal: a dialer's aioquic reads it as CONNECTION_REFUSED with our reason."""

from aioquic.buffer import Buffer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated
from aioquic.quic.packet import QuicErrorCode, pull_quic_header

from meshd.transport.refusal import MAX_REASON, refusal

ADDR = ("192.0.2.1", 4433)


def _dial() -> tuple[QuicConnection, bytes]:
    client = QuicConnection(configuration=QuicConfiguration(is_client=True, alpn_protocols=["meshd/1"]))
    client.connect(ADDR, now=0.0)
    [(initial, _)] = client.datagrams_to_send(now=0.0)
    return client, initial


def _terminated(client: QuicConnection, answer: bytes) -> ConnectionTerminated:
    """What the dialer's aioquic reports once it took ``answer`` and its draining period ended."""
    client.receive_datagram(answer, ADDR, now=0.01)
    client.handle_timer(now=client.get_timer())
    events = []
    while (event := client.next_event()) is not None:
        events.append(event)
    [closed] = [e for e in events if isinstance(e, ConnectionTerminated)]
    return closed


def test_a_dialer_reads_the_refusal_as_connection_refused_with_the_reason():
    client, initial = _dial()
    answer = refusal(pull_quic_header(Buffer(data=initial), host_cid_length=8), "refused the connection: full")
    assert len(answer) < len(initial) // 10  # no amplification: a small datagram for a full-size one
    closed = _terminated(client, answer)
    assert closed.error_code == QuicErrorCode.CONNECTION_REFUSED
    assert closed.reason_phrase == "refused the connection: full"


def test_a_long_reason_is_cut_and_the_packet_still_reads():
    client, initial = _dial()
    closed = _terminated(client, refusal(pull_quic_header(Buffer(data=initial), host_cid_length=8), "x" * 5000))
    assert closed.reason_phrase == "x" * MAX_REASON
