"""Pacing: a sender woken by a timer that fires late still sends at its pacing rate."""

from __future__ import annotations

from aioquic.quic.recovery import QuicPacketPacer

from test_acks import quiet_link

TIMER_FLOOR = 0.00109  # what any trio.sleep shorter than a millisecond took here (epoll waits whole ms)
SIZE = 1472


def timer_clocked_rate(pacer, congestion_window: int, smoothed_rtt: float, wakes: int = 200) -> float:
    """Bytes a second ``pacer`` lets out when its sender wakes every TIMER_FLOOR and sends
    whatever the pacer allows then (as a sender clocked by its pacing timer does)."""
    pacer.update_rate(congestion_window, smoothed_rtt)
    now, sent = 1.0, 0
    for _ in range(wakes):
        now += TIMER_FLOOR
        while pacer.next_send_time(now) is None and sent < 10**6:
            pacer.update_after_send(now)
            sent += 1
    return sent * SIZE / (wakes * TIMER_FLOOR)


def connection_pacer():
    """The pacer a MeshQuicConnection sends with, on a path of SIZE-byte datagrams."""
    link = quiet_link()
    assert link.client.datagram_size == SIZE
    return link.client._loss._pacer


def test_a_sender_woken_a_millisecond_late_keeps_its_pacing_rate():
    window, rtt = 1_000_000, 0.010  # 100 MB/s: 68 packets of 1,472 bytes a millisecond
    rate = window / rtt
    assert timer_clocked_rate(connection_pacer(), window, rtt) >= 0.95 * rate
    # aioquic's own pacer lets 16 packets out per wake: about 22 MB/s here, whatever the rate
    assert timer_clocked_rate(QuicPacketPacer(max_datagram_size=SIZE), window, rtt) < 0.25 * rate


def test_a_slow_path_is_paced_as_aioquic_paces_it():
    window, rtt = 60_000, 0.050  # 1.2 MB/s: under one packet a millisecond; aioquic's own
    ours = timer_clocked_rate(connection_pacer(), window, rtt)  # burst (a quarter of the window) is longer
    assert ours == timer_clocked_rate(QuicPacketPacer(max_datagram_size=SIZE), window, rtt)
    assert ours < 1.2 * window / rtt  # one packet per wake at most: paced
