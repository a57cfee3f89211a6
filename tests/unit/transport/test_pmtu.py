"""The path-MTU search (meshd/transport/pmtu.py) on its own: no sockets, no QUIC."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.transport.pmtu import (
    BASE_PLPMTU,
    MAX_PROBES,
    RAISE_INTERVAL,
    UDP_IPV4_OVERHEAD,
    UDP_IPV6_OVERHEAD,
    PathMtu,
    State,
    ladder,
)

TIMEOUT = 0.1
V4 = ladder(UDP_IPV4_OVERHEAD)


def run(pmtu: PathMtu, path_max: int, *, now: float = 0.0, refuse_above: int | None = None,
        limit: int = 500) -> tuple[list[int], float]:
    """Drive ``pmtu`` over a path that passes datagrams up to ``path_max`` bytes (lost
    probes time out) until the search settles; returns the probe sizes sent and the time."""
    sent = []
    pmtu.start(now)
    for _ in range(limit):
        if pmtu.state is State.SEARCH_COMPLETE:
            return sent, now
        probe = pmtu.probe(now, TIMEOUT)
        if probe is None:
            now = pmtu.deadline
            pmtu.on_timer(now)
            continue
        sent.append(probe.size)
        if refuse_above is not None and probe.size > refuse_above:
            pmtu.probe_refused(probe)
        elif probe.size <= path_max:
            now += 0.001
            pmtu.probe_acked(probe)
    raise AssertionError(f"no end to the search: {sent}")


def test_the_ladder_is_the_common_link_mtus_less_the_headers():
    assert V4 == (1252, 1392, 1452, 1464, 1472, 8972)
    assert ladder(UDP_IPV6_OVERHEAD)[-2:] == (1452, 8952)


def test_a_path_as_large_as_the_local_link_takes_one_probe_per_step_and_no_loss():
    pmtu = PathMtu(max_size=1472, ladder=V4)
    assert pmtu.size == BASE_PLPMTU and pmtu.state is State.BASE
    sent, _ = run(pmtu, path_max=1472)
    assert sent == [1252, 1392, 1452, 1464, 1472]
    assert pmtu.size == 1472 and pmtu.state is State.SEARCH_COMPLETE
    assert pmtu.deadline is None  # at the maximum: nothing to raise later
    assert pmtu.probes_lost == 0


def test_a_size_fails_after_three_lost_probes_then_the_gap_is_halved():
    pmtu = PathMtu(max_size=8972, ladder=V4)
    sent, _ = run(pmtu, path_max=1272)  # a 1300-byte link in the middle
    assert sent[:1] == [1252]
    assert sent[1:1 + MAX_PROBES] == [1392] * MAX_PROBES
    assert 1272 - 16 <= pmtu.size <= 1272
    assert all(s <= 1272 for s in sent if s == pmtu.size)
    assert pmtu.probes_lost == sum(1 for s in sent if s > 1272)


def test_a_refused_probe_fails_its_size_at_once():
    pmtu = PathMtu(max_size=16000, ladder=V4)
    sent, now = run(pmtu, path_max=16000, refuse_above=8972)
    assert sent.count(16000) == 1  # EMSGSIZE: no retries, no waiting
    assert pmtu.size >= 8972 - 16 and now < 1.0


def test_a_late_ack_still_confirms_its_size():
    pmtu = PathMtu(max_size=1472, ladder=V4)
    pmtu.start(0.0)
    first = pmtu.probe(0.0, TIMEOUT)
    pmtu.on_timer(TIMEOUT)  # timed out: one attempt lost
    second = pmtu.probe(TIMEOUT, TIMEOUT)
    assert second.size == first.size and second != first
    pmtu.probe_acked(first)  # the first one's ACK was only late
    assert pmtu.size == first.size
    pmtu.probe_lost(second)  # of a size now confirmed: nothing to learn from it
    assert pmtu.size == first.size and pmtu.probes_lost == 1
    assert pmtu.probe(TIMEOUT, TIMEOUT).size > first.size


def test_the_raise_timer_searches_again_for_what_failed():
    pmtu = PathMtu(max_size=1472, ladder=V4)
    _, now = run(pmtu, path_max=1400)
    assert pmtu.size < 1452 and pmtu.deadline == pytest.approx(now + RAISE_INTERVAL, abs=1)
    now = pmtu.deadline
    pmtu.on_timer(now)
    assert pmtu.state is State.SEARCHING
    run(pmtu, path_max=1472, now=now)  # the path grew meanwhile
    assert pmtu.size == 1472


def black_holed(size: int = 1472) -> PathMtu:
    pmtu = PathMtu(max_size=size, ladder=V4)
    run(pmtu, path_max=size)
    return pmtu


def test_consecutive_losses_of_full_size_packets_fall_back_to_base():
    pmtu = black_holed()
    pmtu.packet_acked(10, 1472)
    assert not pmtu.packets_lost([(11, 1472), (12, 1472)])
    assert not pmtu.packets_lost([(13, 1472)])
    assert pmtu.packets_lost([(14, 1472)])  # the third event in a row
    assert pmtu.size == BASE_PLPMTU and pmtu.black_holes == 1
    assert pmtu.state is State.SEARCHING
    probe = pmtu.probe(10.0, TIMEOUT)
    assert probe.size < 1472  # searching again below the size that stopped passing


def test_losses_that_are_no_black_hole_do_not_count():
    pmtu = black_holed()
    pmtu.packet_acked(100, 1472)
    for _ in range(10):
        assert not pmtu.packets_lost([(50, 1472)])  # sent before a full-size packet that arrived
        assert not pmtu.packets_lost([(101, 1200), (102, 300)])  # small packets say nothing
        assert not pmtu.packets_lost([(103, 8972)])  # larger than the size in use: sent before it fell
        assert not pmtu.packets_lost([])
    assert pmtu.size == 1472


def test_an_acknowledged_full_size_packet_resets_the_count():
    pmtu = black_holed()
    for number in range(0, 40, 2):
        pmtu.packets_lost([(number, 1472)])
        pmtu.packet_acked(number + 1, 1472)
    assert pmtu.size == 1472 and pmtu.black_holes == 0


def test_at_base_there_is_nothing_to_fall_back_from():
    pmtu = PathMtu(max_size=1472, ladder=V4)
    for number in range(10):
        assert not pmtu.packets_lost([(number, 1472)])
    assert pmtu.size == BASE_PLPMTU


def test_a_max_size_at_base_searches_nothing():
    pmtu = PathMtu(max_size=BASE_PLPMTU, ladder=V4)
    pmtu.start(0.0)
    assert pmtu.state is State.SEARCH_COMPLETE and pmtu.probe(0.0, TIMEOUT) is None
    with pytest.raises(ValueError):
        PathMtu(max_size=1000)


@settings(max_examples=200, deadline=None)
@given(
    path_max=st.integers(BASE_PLPMTU, 20000),
    max_size=st.integers(BASE_PLPMTU, 16000),
    use_ladder=st.booleans(),
    fate=st.lists(st.sampled_from(["ok", "lost", "timeout"]), min_size=1, max_size=50),
)
def test_the_size_only_ever_holds_what_a_probe_proved_and_the_search_ends(path_max, max_size, use_ladder, fate):
    """Whatever the path and whatever is lost on the way, the size in use is
    base or an acknowledged size <= the path's, and the search settles."""
    pmtu = PathMtu(max_size=max_size, ladder=V4 if use_ladder else ())
    now, acked = 0.0, {BASE_PLPMTU}
    pmtu.start(now)
    for step in range(2000):
        assert pmtu.size in acked and pmtu.size <= max(BASE_PLPMTU, min(path_max, max_size))
        if pmtu.state is State.SEARCH_COMPLETE:
            break
        probe = pmtu.probe(now, TIMEOUT)
        if probe is None:
            now = pmtu.deadline
            pmtu.on_timer(now)
            continue
        assert pmtu.size < probe.size <= max_size
        what = fate[step % len(fate)]
        if probe.size > path_max or what == "lost":
            pmtu.probe_lost(probe)
        elif what == "ok":
            pmtu.probe_acked(probe)
            acked.add(probe.size)
        # "timeout": neither, the timer will say
    else:
        raise AssertionError("the search did not end")
    if "ok" in fate and "lost" not in fate and "timeout" not in fate:
        # a loss-free path: close to the largest size it carries
        assert pmtu.size >= min(path_max, max_size) - 16
