"""learn.allreduce: DiLoCo's outer all-reduce with no coordinator, every finisher bit-identical."""

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from learn.allreduce import AllReduce, AllReduceError, StreamingAllReduce, partition

TIMEOUT = 10.0


def _keys(n, seed=0):
    rng = random.Random(seed)
    return sorted(rng.randbytes(32) for _ in range(n))


def weighted_mean(parts, weights):
    """Element by element, so any slice of the result is the result of the slices (bit for bit)."""
    total = sum(weights)
    acc = parts[0] * (weights[0] / total)
    for part, weight in zip(parts[1:], weights[1:]):
        acc = acc + part * (weight / total)
    return acc


def median(parts, weights):
    return torch.stack(parts).median(dim=0).values


def _bits(tensor):
    return tensor.view(torch.int32).tolist()


def _one_result(ars):
    """The result every member in ``ars`` (member -> AllReduce) holds, having checked they all
    have one and hold the same bits."""
    results = [ar.result() for ar in ars.values()]
    assert all(r is not None for r in results)
    assert all(_bits(r) == _bits(results[0]) for r in results)
    return results[0]


class Network:
    """Members of one all-reduce exchanging messages in an order drawn from ``rng``; a member
    that dies at a step sends nothing it had not sent by then and receives nothing more."""

    def __init__(self, n, total, *, reduce=weighted_mean, seed=0, deaths=None, weights=None):
        gen = torch.Generator().manual_seed(seed)
        self.members = _keys(n, seed)
        self.vectors = {m: torch.randn(total, generator=gen) for m in self.members}
        self.weights = weights or {m: float(1 + i % 3) for i, m in enumerate(self.members)}
        self.rng = random.Random(seed)
        self.deaths = deaths or {}  # member -> deliveries after which it is dead
        self.steps = 0
        self.queue = []
        self.ars = {m: AllReduce(m, self.members, self.vectors[m], reduce=reduce, weight=self.weights[m],
                                 now=0.0, timeout=TIMEOUT) for m in self.members}
        for m, ar in self.ars.items():
            self.queue += [("part", m, peer, index, part) for peer, index, part in ar.outgoing()]
            self._maybe_broadcast(m, True)

    def alive(self, m):
        return self.deaths.get(m, float("inf")) > self.steps

    def _maybe_broadcast(self, m, changed):
        ar = self.ars[m]
        if changed and ar.reduced(ar.index) is not None:
            tensor, used = ar.reduced(ar.index)
            self.queue += [("reduced", m, peer, ar.index, (tensor.clone(), used)) for peer in self.members if peer != m]

    def drain(self):
        while self.queue:
            kind, src, dst, index, payload = self.queue.pop(self.rng.randrange(len(self.queue)))
            if not (self.alive(src) and self.alive(dst)):
                continue
            self.steps += 1
            if kind == "part":
                self._maybe_broadcast(dst, self.ars[dst].received_part(src, index, payload.clone(),
                                                                        self.weights[src]))
            else:
                self.ars[dst].received_reduced(src, index, *payload)

    def run(self):
        self.drain()
        for at in (TIMEOUT, 2 * TIMEOUT):
            for m in self.survivors():
                self._maybe_broadcast(m, self.ars[m].expire(at))
            self.drain()
        return {m: self.ars[m] for m in self.survivors()}

    def survivors(self):
        return [m for m in self.members if self.alive(m)]


@given(st.integers(0, 10_000), st.integers(1, 40))
@settings(max_examples=100, deadline=None)
def test_a_partition_covers_the_vector_once_in_balanced_contiguous_parts(total, n):
    ranges = partition(total, _keys(n, n))
    assert len(ranges) == n
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no gap, no overlap
    sizes = [hi - lo for lo, hi in ranges]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1
    assert partition(total, _keys(n, n)) == ranges  # deterministic


def test_a_partition_needs_members_and_a_size():
    with pytest.raises(ValueError):
        partition(10, [])
    with pytest.raises(ValueError):
        partition(-1, _keys(2))


@given(st.integers(0, 300), st.integers(0, 2**32), st.sampled_from([weighted_mean, median]))
@settings(max_examples=40, deadline=None)
def test_five_members_end_bit_identical_and_equal_to_the_reduce_over_whole_vectors(total, seed, reduce):
    net = Network(5, total, reduce=reduce, seed=seed)
    finished = net.run()
    result = _one_result(finished)
    whole = reduce([net.vectors[m] for m in net.members], [net.weights[m] for m in net.members])
    assert _bits(result) == _bits(whole)
    for ar in finished.values():
        assert ar.missing_parts() == [] and ar.done()
        assert all(ar.reduced(i)[1] == net.members for i in range(5))  # everyone's part was used


@given(st.integers(5, 200), st.integers(0, 2**32), st.integers(0, 4), st.integers(0, 40))
@settings(max_examples=80, deadline=None)
def test_with_a_member_dead_mid_round_survivors_never_disagree(total, seed, who, when):
    net = Network(5, total, seed=seed, deaths={_keys(5, seed)[who]: when})
    finished = net.run()
    assert len(finished) == 4
    done = [ar.result() for ar in finished.values() if ar.result() is not None]
    assert all(_bits(r) == _bits(done[0]) for r in done)  # all with a result hold the same bits
    for index in range(5):
        have = [ar.reduced(index) for ar in finished.values() if ar.reduced(index) is not None]
        assert all(_bits(t) == _bits(have[0][0]) and used == have[0][1] for t, used in have)
    for ar in finished.values():
        assert ar.done()
        assert (ar.result() is None) == bool(ar.missing_parts())


def test_a_reducer_that_dies_before_reducing_leaves_its_part_missing_everywhere():
    members = _keys(5, 7)
    net = Network(5, 100, seed=7, deaths={members[2]: 0})
    finished = net.run()
    for ar in finished.values():
        assert ar.missing_parts() == [2] and ar.result() is None
    others = [[_bits(ar.reduced(i)[0]) for i in (0, 1, 3, 4)] for ar in finished.values()]
    assert all(o == others[0] for o in others)


def test_a_contributor_whose_parts_never_arrive_is_left_out_of_those_parts_the_same_way_everywhere():
    members = _keys(5, 8)
    cut_off = members[3]
    net = Network(5, 103, seed=8)
    net.queue = [msg for msg in net.queue if msg[1] != cut_off]  # its parts are lost; it still reduces its own
    finished = net.run()
    results = [ar.result() for ar in finished.values()]
    assert all(r is not None and _bits(r) == _bits(results[0]) for r in results)
    others = [m for m in members if m != cut_off]
    without = weighted_mean([net.vectors[m] for m in others], [net.weights[m] for m in others])
    with_all = weighted_mean([net.vectors[m] for m in members], [net.weights[m] for m in members])
    ranges = partition(103, members)
    for index, (lo, hi) in enumerate(ranges):
        expected, used = (with_all, members) if index == 3 else (without, others)
        assert _bits(results[0][lo:hi]) == _bits(expected[lo:hi])
        assert all(ar.reduced(index)[1] == used for ar in finished.values())


def test_a_reducer_waits_for_every_contributor_until_the_parts_deadline():
    members = _keys(3, 1)
    vectors = [torch.full((6,), float(i)) for i in range(3)]
    ar = AllReduce(members[0], members, vectors[0], reduce=weighted_mean, now=100.0, timeout=5.0)
    assert ar.index == 0 and ar.parts_deadline == 105.0 and ar.deadline == 110.0
    assert ar.contributors_missing() == members[1:]
    assert ar.received_part(members[1], 0, vectors[1][:2].clone())
    assert ar.reduced(0) is None
    assert not ar.expire(104.9) and ar.reduced(0) is None
    assert ar.contributors_missing() == [members[2]]
    assert ar.expire(105.0)  # reduced now, over the two it has
    tensor, used = ar.reduced(0)
    assert used == members[:2] and tensor.tolist() == [0.5, 0.5]
    assert not ar.received_part(members[2], 0, vectors[2][:2].clone())  # too late: ignored
    assert not ar.expire(106.0)
    assert ar.reduced(0)[1] == members[:2]


def test_a_reducer_reduces_as_soon_as_every_part_is_in():
    members = _keys(3, 2)
    ar = AllReduce(members[1], members, torch.ones(9), reduce=weighted_mean, weight=2.0, now=0.0, timeout=5.0)
    assert [(peer, index, part.tolist()) for peer, index, part in ar.outgoing()] == [
        (members[0], 0, [1.0] * 3), (members[2], 2, [1.0] * 3)]
    assert ar.received_part(members[0], 1, torch.zeros(3), 1.0)
    assert ar.reduced(1) is None
    assert ar.received_part(members[2], 1, torch.full((3,), 4.0), 1.0)
    tensor, used = ar.reduced(1)
    assert used == members and tensor.tolist() == [1.5] * 3  # (0·1 + 1·2 + 4·1) / 4


def test_the_result_is_the_parts_in_order_once_all_are_in():
    members = _keys(3, 3)
    ar = AllReduce(members[2], members, torch.zeros(7), reduce=weighted_mean, now=0.0, timeout=5.0)
    ranges = partition(7, members)
    for peer in members[:2]:
        ar.received_part(peer, 2, torch.zeros(2))
    assert ar.result() is None and not ar.done()
    ar.received_reduced(members[0], 0, torch.arange(0.0, 3.0), members)
    assert ar.result() is None
    ar.received_reduced(members[1], 1, torch.arange(3.0, 5.0), members[1:])
    assert ranges == [(0, 3), (3, 5), (5, 7)]
    assert ar.result().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 0.0, 0.0] and ar.done()
    assert ar.reduced(1)[1] == members[1:]


def test_a_member_alone_has_its_result_at_once():
    me = _keys(1)[0]
    ar = AllReduce(me, [me], torch.arange(5.0), reduce=weighted_mean, now=0.0, timeout=5.0)
    assert ar.outgoing() == [] and ar.result().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_parts_whose_reduction_never_comes_are_missing_after_the_deadline():
    members = _keys(3, 4)
    ar = AllReduce(members[0], members, torch.zeros(6), reduce=weighted_mean, now=0.0, timeout=5.0)
    ar.received_reduced(members[1], 1, torch.zeros(2), members)
    assert ar.missing_parts() == [] and not ar.done()
    ar.expire(9.9)
    assert ar.missing_parts() == [] and ar.reduced(0)[1] == [members[0]]
    ar.expire(10.0)
    assert ar.missing_parts() == [2] and ar.done() and ar.result() is None
    assert not ar.received_reduced(members[2], 2, torch.zeros(2), members)  # decided: stays missing
    assert ar.missing_parts() == [2]


def test_a_contributor_that_left_is_not_waited_for_and_its_part_is_missing_at_once():
    members = _keys(3, 5)
    me, stays, leaves = members[0], members[1], members[2]
    ar = AllReduce(me, members, torch.zeros(6), reduce=weighted_mean, now=0.0, timeout=5.0)
    assert ar.received_part(stays, 0, torch.full((2,), 3.0))
    assert ar.reduced(0) is None
    assert ar.left(leaves)  # every part but the leaver's is in: reduced now, not at the parts deadline
    assert ar.reduced(0)[1] == [me, stays] and ar.reduced(0)[0].tolist() == [1.5, 1.5]
    assert ar.missing_parts() == [2] and not ar.done()  # its slice will not come; the other one still may
    ar.received_reduced(stays, 1, torch.zeros(2), [me, stays])
    assert ar.done() and ar.result() is None and ar.missing_parts() == [2]
    assert not ar.received_reduced(leaves, 2, torch.zeros(2), members)  # decided: stays missing
    assert not ar.left(leaves)  # said twice: nothing more happens


def test_a_reducer_that_heard_a_contributor_leave_reduces_when_the_others_are_in():
    members = _keys(4, 6)
    me = members[1]
    ar = AllReduce(me, members, torch.ones(8), reduce=weighted_mean, now=0.0, timeout=5.0)
    assert not ar.left(members[3])  # two parts still to come
    assert ar.received_part(members[0], 1, torch.ones(2))
    assert ar.reduced(1) is None
    assert ar.received_part(members[2], 1, torch.ones(2))
    assert ar.reduced(1)[1] == members[:3]  # reduced with the last part it waited for
    assert not ar.received_part(members[3], 1, torch.ones(2))  # sent before it left, came after: ignored
    with pytest.raises(AllReduceError, match="this member"):
        ar.left(me)
    with pytest.raises(AllReduceError, match="not a contributor"):
        ar.left(b"\x00" * 32)


def test_members_that_heard_a_leave_at_different_moments_still_hold_the_same_bits():
    net = Network(4, 50, seed=9)
    leaver = net.members[3]
    for m in net.members[:3]:
        net._maybe_broadcast(m, net.ars[m].left(leaver))
    net.deaths[leaver] = 0
    finished = net.run()
    results = {m: [ar.reduced(i) for i in range(3)] for m, ar in finished.items()}
    first = next(iter(results.values()))
    for got in results.values():
        assert all(_bits(t) == _bits(f[0]) and used == f[1] for (t, used), f in zip(got, first))
    assert all(ar.missing_parts() == [3] for ar in finished.values())


@pytest.mark.parametrize("call, message", [
    (lambda ar, m: ar.received_part(m[1], 1, torch.zeros(2)), "reduces part 0"),
    (lambda ar, m: ar.received_part(b"x" * 32, 0, torch.zeros(2)), "not a contributor"),
    (lambda ar, m: ar.received_part(m[0], 0, torch.zeros(2)), "twice"),
    (lambda ar, m: ar.received_part(m[1], 0, torch.zeros(3)), "2 values"),
    (lambda ar, m: ar.received_part(m[1], 0, torch.zeros(1, 2)), "2 values"),
    (lambda ar, m: ar.received_part(m[1], 0, torch.zeros(2, dtype=torch.float64)), "float32"),
    (lambda ar, m: ar.received_part(m[1], 0, torch.tensor([1.0, float("nan")])), "finite"),
    (lambda ar, m: ar.received_part(m[1], 0, torch.zeros(2), 0.0), "weight"),
    (lambda ar, m: ar.received_reduced(m[1], 2, torch.zeros(2), m), "reduced by"),
    (lambda ar, m: ar.received_reduced(m[0], 0, torch.zeros(2), m), "reduced by"),
    (lambda ar, m: ar.received_reduced(m[1], 1, torch.zeros(3), m), "2 values"),
    (lambda ar, m: ar.received_reduced(m[1], 1, torch.tensor([0.0, float("inf")]), m), "finite"),
    (lambda ar, m: ar.received_reduced(m[1], 1, torch.zeros(2), [m[2], m[1]]), "sorted"),
    (lambda ar, m: ar.received_reduced(m[1], 1, torch.zeros(2), [m[1], m[1]]), "sorted"),
    (lambda ar, m: ar.received_reduced(m[1], 1, torch.zeros(2), [m[0], m[2]]), "its own"),
    (lambda ar, m: ar.received_reduced(m[1], 1, torch.zeros(2), [m[1], b"x" * 32]), "not a contributor"),
    (lambda ar, m: ar.received_reduced(m[1], 1, torch.zeros(2), "all"), "sorted"),
    (lambda ar, m: ar.received_reduced(m[1], 7, torch.zeros(2), m), "no part 7"),
])
def test_what_a_peer_sends_is_checked(call, message):
    members = _keys(3, 5)
    ar = AllReduce(members[0], members, torch.zeros(6), reduce=weighted_mean, now=0.0, timeout=5.0)
    with pytest.raises(AllReduceError, match=message):
        call(ar, members)


def test_the_same_reduced_part_twice_is_refused():
    members = _keys(2, 6)
    ar = AllReduce(members[0], members, torch.zeros(4), reduce=weighted_mean, now=0.0, timeout=5.0)
    ar.received_reduced(members[1], 1, torch.zeros(2), members)
    with pytest.raises(AllReduceError, match="twice"):
        ar.received_reduced(members[1], 1, torch.zeros(2), members)


def test_an_all_reduce_is_set_up_from_an_agreed_list_and_a_float32_vector():
    members = _keys(3, 9)
    make = lambda **kw: AllReduce(**{"me": members[0], "members": members, "vector": torch.zeros(6),
                                     "reduce": weighted_mean, "now": 0.0, "timeout": 5.0, **kw})
    for bad in [{"members": list(reversed(members))}, {"members": members + members[:1]}, {"members": []},
                {"vector": torch.zeros(2, 3)}, {"vector": torch.zeros(6, dtype=torch.int64)},
                {"weight": 0.0}, {"weight": float("nan")}, {"timeout": -1.0}]:
        with pytest.raises(ValueError):
            make(**bad)


def test_a_member_off_the_list_follows_the_round_sends_nothing_and_ends_with_the_same_bits():
    net = Network(3, 50, seed=4)
    follower = b"\xff" * 32  # above every member's key, in no one's list
    ar = AllReduce(follower, net.members, torch.zeros(50), reduce=weighted_mean, now=0.0, timeout=TIMEOUT)
    assert ar.index is None and ar.outgoing() == []
    with pytest.raises(AllReduceError, match="follows"):
        ar.received_part(net.members[0], 0, torch.zeros(17))
    finished = net.run()
    for index, reducer in enumerate(net.members):
        assert ar.received_reduced(reducer, index, *finished[reducer].reduced(index))
    assert _bits(ar.result()) == _bits(finished[net.members[0]].result())
    assert ar.expire(2 * TIMEOUT) is False and ar.missing_parts() == []


def test_a_reduce_that_returns_the_wrong_size_is_a_bug_and_says_so():
    me = _keys(1)[0]
    with pytest.raises(AllReduceError, match="reduce returned"):
        AllReduce(me, [me], torch.zeros(4), reduce=lambda parts, weights: torch.zeros(3), now=0.0, timeout=1.0)


class _CountingKey(bytes):
    compared = 0

    def __eq__(self, other):
        _CountingKey.compared += 1
        return bytes.__eq__(self, other)

    __hash__ = bytes.__hash__


def test_taking_a_reduced_part_costs_key_comparisons_linear_in_the_members():
    n = 1024
    members = _keys(n, 7)
    ar = AllReduce(members[0], members, torch.zeros(n), reduce=weighted_mean, now=0.0, timeout=TIMEOUT)
    used = [_CountingKey(m) for m in members]  # as a peer's list arrives: equal keys, not the same objects
    _CountingKey.compared = 0
    assert ar.received_reduced(members[1], 1, torch.zeros(1), used)
    assert _CountingKey.compared <= 20 * n, f"{_CountingKey.compared} key comparisons for {n} members"


# --- a reducer that adds parts as they stream in -----------------------------------------------


class StreamingNetwork:
    """Members of one streamed all-reduce: each part goes as a head, chunks and an end, in
    order on its own link, the links interleaved in an order drawn from ``rng``; the
    reduced parts go whole.  ``cut`` names links (sender, reducer) that stop after that many
    chunks, the sender then failing its part there."""

    def __init__(self, n, total, *, seed=0, chunk=3, cut=None, in_place=False):
        gen = torch.Generator().manual_seed(seed)
        self.members = _keys(n, seed)
        self.vectors = {m: torch.randn(total, generator=gen) for m in self.members}
        self.originals = {m: v.clone() for m, v in self.vectors.items()}
        self.weights = {m: float(1 + i % 3) for i, m in enumerate(self.members)}
        self.rng = random.Random(seed)
        self.ars = {m: StreamingAllReduce(m, self.members, self.vectors[m],
                                          into=self.vectors[m] if in_place else torch.zeros(total),
                                          weight=self.weights[m], now=0.0, timeout=TIMEOUT)
                    for m in self.members}
        self.links = {}
        for m, ar in self.ars.items():
            for peer, index, part in ar.outgoing():
                msgs = [("announce", index, self.weights[m])]
                msgs += [("chunk", at, part[at:at + chunk].clone()) for at in range(0, part.numel(), chunk)]
                msgs.append(("done",))
                if cut and (m, peer) in cut:
                    msgs = msgs[:1 + cut[(m, peer)]] + [("fail",)]
                self.links[(m, peer)] = msgs
        self.sent = set()  # reducers whose reduced part went to everyone

    def _deliver(self, src, dst, msg):
        """Hand ``msg`` to ``dst``; False if it must wait (chunks wait for the weights to settle)."""
        ar = self.ars[dst]
        if msg[0] == "announce":
            ar.announce(src, msg[1], msg[2])
        elif msg[0] == "chunk" and not ar.settled:
            return False
        elif msg[0] == "chunk":
            ar.add(src, msg[1], msg[2])
        elif msg[0] == "done":
            ar.part_done(src)
        else:
            ar.fail(src)
        return True

    def _drain(self, sent):
        progress = True
        while progress:
            progress = False
            for link in self.rng.sample(sorted(self.links), len(self.links)):
                msgs = self.links[link]
                try:
                    if msgs and self._deliver(*link, msgs[0]):
                        msgs.pop(0)
                        progress = True
                except AllReduceError:  # refused: the sender's part there ends
                    msgs.clear()
            for m, ar in self.ars.items():
                got = ar.reduced(ar.index)
                if got is not None and m not in sent:
                    sent.add(m)
                    progress = True
                    for peer in self.members:
                        if peer != m:
                            self.ars[peer].received_reduced(m, ar.index, got[0].clone(), got[1])

    def run(self, deadlines=(TIMEOUT, 2 * TIMEOUT)):
        sent = self.sent
        self._drain(sent)
        for at in deadlines:
            for ar in self.ars.values():
                ar.expire(at)
            self._drain(sent)
        return self.ars


@given(st.integers(1, 200), st.integers(0, 2**32), st.booleans())
@settings(max_examples=40, deadline=None)
def test_streamed_reductions_end_bit_identical_and_equal_to_the_mean_to_rounding(total, seed, in_place):
    net = StreamingNetwork(5, total, seed=seed, in_place=in_place)
    ars = net.run()
    whole = weighted_mean([net.originals[m] for m in net.members], [net.weights[m] for m in net.members])
    assert torch.allclose(_one_result(ars), whole, atol=1e-6, rtol=1e-5)
    assert all(ar.reduced(i)[1] == net.members for ar in ars.values() for i in range(5))


def test_a_part_that_fails_midway_loses_its_reducers_part_for_everyone_and_no_other():
    members = _keys(4, 11)
    net = StreamingNetwork(4, 40, seed=11, cut={(members[0], members[2]): 1})
    ars = net.run(deadlines=())  # no deadline passed: the failure itself decides
    assert ars[members[2]].missing_parts() == [2]
    assert all(ar.reduced(2) is None for ar in ars.values())
    net.run()
    assert all(ar.missing_parts() == [2] for ar in ars.values())
    for index in (0, 1, 3):
        got = [ar.reduced(index) for ar in ars.values()]
        assert all(_bits(t) == _bits(got[0][0]) and used == members for t, used in got)


def test_a_part_that_fails_before_any_value_was_added_may_come_again():
    members = _keys(3, 12)
    ar = StreamingAllReduce(members[0], members, torch.ones(6), into=torch.zeros(6), now=0.0, timeout=5.0)
    assert ar.announce(members[1], 0) and ar.announce(members[2], 0)
    assert ar.settled
    ar.fail(members[1])  # its lane broke before the first chunk: it sends again over QUIC
    assert ar.announce(members[1], 0)
    ar.add(members[1], 0, torch.full((2,), 4.0))
    ar.part_done(members[1])
    ar.add(members[2], 0, torch.full((2,), 7.0))
    ar.part_done(members[2])
    tensor, used = ar.reduced(0)
    assert used == members and tensor.tolist() == [4.0, 4.0]  # (1 + 4 + 7) / 3
    assert ar.missing_parts() == []


def test_a_part_not_announced_by_the_parts_deadline_is_left_out_and_refused_after():
    members = _keys(3, 13)
    ar = StreamingAllReduce(members[0], members, torch.full((6,), 2.0), into=torch.zeros(6), weight=1.0,
                            now=0.0, timeout=5.0)
    assert ar.announce(members[1], 0, 3.0)
    assert not ar.settled and not ar.expire(4.9)
    assert not ar.expire(5.0) and ar.settled  # settled over the two announced; one still streams
    assert not ar.announce(members[2], 0)  # too late
    ar.add(members[1], 0, torch.full((2,), 6.0))
    ar.part_done(members[1])
    tensor, used = ar.reduced(0)
    assert used == members[:2] and tensor.tolist() == [5.0, 5.0]  # (2·1 + 6·3) / 4
    assert ar.contributors_missing() == [members[2]]


def test_parts_that_came_whole_before_the_weights_settled_are_added_when_they_do():
    members = _keys(3, 14)
    ar = StreamingAllReduce(members[2], members, torch.zeros(6), into=torch.zeros(6), now=0.0, timeout=5.0)
    assert ar.received_part(members[0], 2, torch.full((2,), 3.0))
    assert ar.reduced(2) is None and not ar.settled
    assert ar.received_part(members[1], 2, torch.full((2,), 6.0))
    assert ar.reduced(2)[0].tolist() == [3.0, 3.0]


def test_a_settled_part_not_done_halfway_to_the_deadline_makes_the_reducers_part_missing():
    """Its reduced part would come too late for a member whose round began a little earlier."""
    members = _keys(2, 15)
    ar = StreamingAllReduce(members[0], members, torch.zeros(4), into=torch.zeros(4), now=0.0, timeout=5.0)
    assert ar.announce(members[1], 0)
    ar.add(members[1], 0, torch.ones(1))
    assert ar.reduce_by == 7.5
    assert not ar.expire(7.4) and ar.missing_parts() == []
    assert not ar.expire(7.5)
    assert ar.missing_parts() == [0] and not ar.done()
    with pytest.raises(AllReduceError, match="not being taken"):
        ar.add(members[1], 1, torch.ones(1))  # lost: the rest of the part is refused
    ar.expire(10.0)
    assert ar.missing_parts() == [0, 1] and ar.done() and ar.result() is None


@pytest.mark.parametrize("call, message", [
    (lambda ar, m: ar.add(m[1], 1, torch.zeros(1)), "out of order"),
    (lambda ar, m: ar.add(m[1], 0, torch.zeros(3)), "past the part's end"),
    (lambda ar, m: ar.add(m[1], 0, torch.zeros(1, dtype=torch.float64)), "float32"),
    (lambda ar, m: ar.part_done(m[1]), "ended early"),
])
def test_a_streamed_part_out_of_order_too_long_or_bad_loses_the_reducers_part(call, message):
    members = _keys(3, 16)
    ar = StreamingAllReduce(members[0], members, torch.zeros(6), into=torch.zeros(6), now=0.0, timeout=5.0)
    ar.announce(members[1], 0)
    ar.announce(members[2], 0)
    with pytest.raises(AllReduceError, match=message):
        call(ar, members)
    assert ar.missing_parts() == [0]
    assert not ar.announce(members[1], 0)
    with pytest.raises(AllReduceError, match="not being taken"):
        ar.add(members[2], 0, torch.zeros(1))


def test_a_streamed_part_is_checked_as_a_whole_one_is():
    members = _keys(3, 17)
    ar = StreamingAllReduce(members[0], members, torch.zeros(6), into=torch.zeros(6), now=0.0, timeout=5.0)
    with pytest.raises(AllReduceError, match="reduces part 0"):
        ar.announce(members[1], 1)
    with pytest.raises(AllReduceError, match="not a contributor"):
        ar.announce(b"x" * 32, 0)
    ar.announce(members[1], 0)
    with pytest.raises(AllReduceError, match="twice"):
        ar.announce(members[1], 0)
    with pytest.raises(AllReduceError, match="not being taken"):
        ar.add(members[1], 0, torch.zeros(1))  # not settled yet
    with pytest.raises(ValueError, match="float32 vector"):
        StreamingAllReduce(members[0], members, torch.zeros(6), into=torch.zeros(5), now=0.0, timeout=5.0)


def test_a_value_that_is_not_finite_in_a_streamed_part_loses_the_reducers_part():
    members = _keys(2, 18)
    ar = StreamingAllReduce(members[0], members, torch.zeros(4), into=torch.zeros(4), now=0.0, timeout=5.0)
    ar.announce(members[1], 0)
    ar.add(members[1], 0, torch.tensor([1.0, float("nan")]))
    ar.part_done(members[1])
    assert ar.reduced(0) is None and ar.missing_parts() == [0]


def test_a_streaming_member_alone_has_its_result_at_once():
    me = _keys(1)[0]
    ar = StreamingAllReduce(me, [me], torch.arange(5.0), into=torch.zeros(5), now=0.0, timeout=5.0)
    assert ar.result().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


@given(st.lists(st.tuples(st.sampled_from(["announce", "add", "done", "fail", "expire"]), st.integers(0, 3),
                          st.integers(-2, 12), st.integers(0, 8), st.sampled_from([1.0, float("nan"), -3.5])),
                max_size=30))
@settings(max_examples=200, deadline=None)
def test_any_sequence_of_peer_calls_on_a_streamed_reduction_raises_only_allreduce_errors(ops):
    members = _keys(4, 19)
    ar = StreamingAllReduce(members[0], members, torch.ones(40), into=torch.zeros(40), now=0.0, timeout=5.0)
    clock = 0.0
    for op, who, at, n, value in ops:
        peer = members[who]
        try:
            if op == "announce":
                ar.announce(peer, 0 if at >= 0 else 1, max(n, 1))
            elif op == "add":
                ar.add(peer, at, torch.full((n,), value))
            elif op == "done":
                ar.part_done(peer)
            elif op == "fail":
                ar.fail(peer)
            else:
                clock += 5.0
                ar.expire(clock)
        except AllReduceError:
            pass
    got = ar.reduced(0)
    if got is not None:
        assert got[0].shape == (10,) and bool(torch.isfinite(got[0]).all()) and members[0] in got[1]
        assert 0 not in ar.missing_parts()
