"""FairShare: which served calls run now, fair between peers once busy (meshd/rpc/fair.py)."""

from meshd.rpc.fair import FairShare


def arrive(share: FairShare, peer: str, name: str) -> bool:
    """A call ``name`` of ``peer`` arrives: True if it starts at once, else it waits."""
    if share.try_start(peer):
        return True
    share.wait(peer, name)
    return False


def test_without_a_busy_limit_every_call_starts_at_once():
    share = FairShare()
    assert all(arrive(share, "a", f"a{n}") for n in range(1000))
    assert (share.total, share.waiting, share.end("a")) == (1000, 0, [])


def test_once_busy_a_peer_running_its_share_waits_and_a_peer_running_fewer_starts():
    share = FairShare(busy=2, share=1)
    assert [arrive(share, "a", f"a{n}") for n in range(3)] == [True, True, False]
    assert arrive(share, "b", "b0")  # busy, but b runs fewer than its share
    assert not arrive(share, "b", "b1")
    assert share.end("a") == []  # still busy, a and b run their shares
    assert share.end("b") == ["b1"]  # b has 1 call in flight, a 2: b's goes before a's older one
    assert share.end("a") == ["a2"]
    assert (share.running("a"), share.running("b"), share.waiting) == (1, 1, 0)


def test_between_equals_the_call_waiting_longest_goes_first():
    share = FairShare(busy=3, share=1)
    assert all(arrive(share, peer, f"{peer}0") for peer in "abc")
    assert not any(arrive(share, peer, f"{peer}1") for peer in "cba")
    assert share.end("a") == ["a1"]  # a: 1 in flight, b and c 2
    assert share.end("b") == ["b1"]
    assert [share.end("c"), share.end("a"), share.end("b")] == [["c1"], [], []]


def test_a_peer_never_overtakes_its_own_waiting_calls():
    share = FairShare(busy=1, share=1)
    assert arrive(share, "a", "a0")
    assert not arrive(share, "a", "a1")
    assert share.end("a") == ["a1"]
    assert not arrive(share, "a", "a2")


def test_a_call_that_leaves_while_waiting_never_starts():
    share = FairShare(busy=1, share=1)
    assert arrive(share, "a", "a0")
    assert not arrive(share, "a", "a1") and not arrive(share, "a", "a2")
    share.leave("a", "a1")
    assert share.end("a") == ["a2"] and share.waiting == 0
