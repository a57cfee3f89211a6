"""Path-MTU probes in MeshQuicConnection: two QUIC state machines joined by an
in-memory link that drops datagrams above its MTU (no sockets, no trio)."""

import ssl

from aioquic.buffer import Buffer
from aioquic.quic import events as ev
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import pull_quic_header

from meshd.identity import Identity
from meshd.transport.connection import ALPN
from meshd.transport.quic import DatagramSizeChanged, MeshQuicConnection, PathMtuSearchDone
from meshd.transport.pmtu import BASE_PLPMTU, UDP_IPV4_OVERHEAD, State, ladder
from meshd.transport.tls import identity_certificate

CLIENT, SERVER = ("10.0.0.1", 4100), ("10.0.0.2", 4100)
WINDOW = 64 << 20


def configuration(is_client: bool) -> QuicConfiguration:
    identity = Identity.generate()
    return QuicConfiguration(
        is_client=is_client, alpn_protocols=[ALPN], max_datagram_size=BASE_PLPMTU,
        max_data=WINDOW, max_stream_data=WINDOW, verify_mode=ssl.CERT_NONE,
        certificate=identity_certificate(identity), private_key=identity.private_key,
    )


class Link:
    """A client and a server QUIC connection on a path that carries UDP payloads up to
    ``mtu`` bytes and silently drops larger ones (a black hole: no ICMP).  The sender's
    own link refuses payloads above ``local_mtu`` (EMSGSIZE)."""

    def __init__(self, mtu: int, *, max_size: int = 8972, local_mtu: int | None = None,
                 server_probes: bool = True, server_class=MeshQuicConnection):
        self.mtu, self.local_mtu, self.now = mtu, local_mtu, 0.0
        self.sent: dict[str, list[int]] = {"client": [], "server": []}
        self.events: dict[str, list] = {"client": [], "server": []}
        self.received = 0
        self.client = MeshQuicConnection(configuration=configuration(True))
        self.client.enable_pmtud(max_size, ladder(UDP_IPV4_OVERHEAD))
        self.client.connect(SERVER, now=self.now)
        first = self.client.datagrams_to_send(self.now)
        header = pull_quic_header(Buffer(data=first[0][0]), host_cid_length=8)
        self.server = server_class(configuration=configuration(False),
                                   original_destination_connection_id=header.destination_cid)
        if server_probes and isinstance(self.server, MeshQuicConnection):
            self.server.enable_pmtud(max_size, ladder(UDP_IPV4_OVERHEAD))
        for data, _ in first:
            self.server.receive_datagram(data, CLIENT, self.now)

    def _carry(self, name: str, src, dst, src_addr) -> None:
        datagrams = [data for data, _ in src.datagrams_to_send(self.now)]
        probe = src.pmtu_probe(self.now) if isinstance(src, MeshQuicConnection) else None
        if probe is not None:
            data, _, p = probe
            assert len(data) == p.size  # a probe is exactly the size it tests
            if self.local_mtu is not None and len(data) > self.local_mtu:
                src.pmtu_probe_refused(p)
            else:
                datagrams.append(data)
        for data in datagrams:
            self.sent[name].append(len(data))
            if len(data) <= self.mtu:
                dst.receive_datagram(data, src_addr, self.now)

    def step(self, dt: float = 0.0005) -> None:
        self.now += dt
        for conn in (self.client, self.server):
            timer = conn.get_timer()
            if timer is not None and timer <= self.now:
                conn.handle_timer(self.now)
        self._carry("client", self.client, self.server, CLIENT)
        self._carry("server", self.server, self.client, SERVER)
        for name, conn in (("client", self.client), ("server", self.server)):
            while (event := conn.next_event()) is not None:
                self.events[name].append(event)
                if isinstance(event, ev.StreamDataReceived):
                    self.received += len(event.data)

    def settle(self, seconds: float = 10.0) -> None:
        """Run until the client's search is done."""
        end = self.now + seconds
        while self.client.pmtu is None or self.client.pmtu.state is not State.SEARCH_COMPLETE:
            assert self.now < end, f"no end to the search: {self.client.pmtu}"
            self.step()

    def send(self, nbytes: int, seconds: float = 30.0, on_step=None) -> None:
        """Send ``nbytes`` on a new stream from the client and run until they all arrived."""
        stream = self.client.get_next_available_stream_id()
        self.client.send_stream_data(stream, b"x" * nbytes, end_stream=True)
        start, end = self.received, self.now + seconds
        while self.received - start < nbytes:
            assert self.now < end, f"{self.received - start} of {nbytes} bytes arrived"
            self.step()
            if on_step is not None:
                on_step()


def test_a_1500_byte_path_settles_on_1472_byte_datagrams_with_one_probe_per_step():
    link = Link(mtu=1472, max_size=1472)
    link.settle()
    pmtu = link.client.pmtu
    assert link.client.datagram_size == 1472 and pmtu.probes_lost == 0
    assert pmtu.probes_sent == len(ladder(UDP_IPV4_OVERHEAD)) - 1
    sizes = [e.size for e in link.events["client"] if isinstance(e, DatagramSizeChanged)]
    assert sizes == [1252, 1392, 1452, 1464, 1472]
    assert [e.size for e in link.events["client"] if isinstance(e, PathMtuSearchDone)] == [1472]
    link.send(1 << 20)
    assert max(link.sent["client"][-50:]) == 1472  # the bulk went in full-size datagrams


def test_lost_probes_cost_no_congestion_and_no_retransmission():
    """Probes larger than the path are lost while bulk data flows; only the probes are lost,
    and their loss is no congestion event: the window never shrinks."""
    link = Link(mtu=1300)
    lost = []
    recovery = link.client._loss
    real = recovery._on_packets_lost

    def record(*, packets, space, **kwargs):
        packets = list(packets)
        lost.extend(packets)
        real(packets=packets, space=space, **kwargs)

    recovery._on_packets_lost = record
    windows = []
    link.send(8 << 20, on_step=lambda: windows.append(recovery.congestion_window))
    link.settle()
    assert link.client.pmtu.probes_lost >= 3 and lost
    assert all(not p.in_flight for p in lost)  # every lost packet was a probe
    assert windows == sorted(windows)  # the congestion window only grew
    assert recovery._cc._congestion_recovery_start_time == 0.0  # reno never entered recovery
    assert BASE_PLPMTU < link.client.datagram_size <= 1300


def test_a_path_that_shrinks_is_a_black_hole_found_by_losses_and_left():
    link = Link(mtu=8972)
    link.settle()
    assert link.client.datagram_size == 8972

    def shrink():
        if link.received > 4 << 20:
            link.mtu = 1300  # a router on the way now drops anything larger, silently

    link.send(16 << 20, on_step=shrink)
    assert link.client.pmtu.black_holes == 1
    reasons = [e.reason for e in link.events["client"] if isinstance(e, DatagramSizeChanged)]
    assert "black hole" in reasons
    link.settle()
    assert BASE_PLPMTU < link.client.datagram_size <= 1300
    link.send(1 << 20)


def test_a_probe_the_local_link_refuses_fails_at_once():
    link = Link(mtu=16000, max_size=16000, local_mtu=8972)
    link.settle(seconds=1.0)
    assert link.client.datagram_size >= 8972 - 16
    assert link.client.pmtu.probes_lost == 0  # refusals are not losses, and need no timeout


def test_any_quic_peer_answers_probes_and_a_peer_that_does_not_probe_stays_at_base():
    """aioquic as it comes (an older meshd, or any QUIC stack) acknowledges a PING+PADDING
    probe like any packet: we raise our size, it keeps sending 1200-byte datagrams."""
    link = Link(mtu=1472, max_size=1472, server_class=QuicConnection)
    link.settle()
    assert link.client.datagram_size == 1472
    assert link.server._max_datagram_size == BASE_PLPMTU
    link.send(1 << 20)
    assert max(link.sent["server"]) <= BASE_PLPMTU


def test_without_pmtud_nothing_is_probed():
    link = Link(mtu=9000, server_probes=False)
    link.client._pmtu_limit = None  # as if enable_pmtud had not been called
    for _ in range(200):
        link.step()
    assert link.client.pmtu is None and link.server.pmtu is None
    assert max(link.sent["client"] + link.sent["server"]) <= BASE_PLPMTU


def test_a_peer_that_moves_to_another_address_is_searched_again_from_base():
    link = Link(mtu=1472, max_size=1472)
    link.settle()
    link.step(0.05)
    assert link.server.datagram_size == 1472
    moved = ("10.0.0.9", 4100)  # the client's NAT rebound: its packets now come from here
    link._carry = _from(link, moved)
    link.send(64 << 10)
    changes = [e for e in link.events["server"] if isinstance(e, DatagramSizeChanged)]
    assert any(e.reason == "new path" and e.size == BASE_PLPMTU for e in changes)
    end = link.now + 5
    while link.server.pmtu.state is not State.SEARCH_COMPLETE or link.server.datagram_size < 1472:
        assert link.now < end
        link.step()
    assert link.server._pmtu_addr == moved


def _from(link: Link, client_addr):
    """``link._carry`` with the client's datagrams arriving from ``client_addr``."""
    carry = Link._carry

    def moved(name, src, dst, src_addr):
        carry(link, name, src, dst, client_addr if src is link.client else src_addr)
    return moved
