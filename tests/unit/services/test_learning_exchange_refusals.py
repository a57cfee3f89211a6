"""What a group answers a peer asking for all-reduce slices it cannot give: a clear RPC error, never a crash."""

import pytest
from fakehost import FakeHost

from meshd.identity import Identity
from meshd.rpc import InvalidArgument, Unavailable
from meshd.services.learning import LearningSection
from meshd.services.learning.bulk import Bulk
from meshd.services.learning.group import Group

PEER = Identity.generate().peer_id


def _group(tmp_path) -> Group:
    config = LearningSection(round_timeout_min=0.01, round_timeout_max=0.05)  # exchanges time out at once
    host = FakeHost(tmp_path)
    return Group(host, config, "run42", algorithm="diloco", rule="mean", bulk=Bulk(host, enabled=False))


async def _drain(stream) -> list:
    return [item async for item in stream]


async def test_a_slice_never_reduced_here_is_unavailable_after_the_wait(tmp_path):
    group = _group(tmp_path)
    with pytest.raises(Unavailable, match="not reduced here"):
        await _drain(group.serve_reduced(PEER, {"group": "run42", "key": [0, 0]}))


@pytest.mark.parametrize("key, error", [([5, 0], Unavailable), ([0], InvalidArgument), ([0, "x"], InvalidArgument),
                                        ([-1, 0], InvalidArgument), ("0,0", InvalidArgument)])
async def test_exchanges_outside_the_current_rounds_or_malformed_are_refused(tmp_path, key, error):
    group = _group(tmp_path)
    with pytest.raises(error):
        await _drain(group.serve_reduced(PEER, {"group": "run42", "key": key}))
    assert not group._exchanges  # a refused request keeps nothing


def _patient_group(tmp_path) -> Group:
    config = LearningSection(round_timeout_min=600.0, round_timeout_max=600.0)  # a wait would be 10 minutes
    host = FakeHost(tmp_path)
    return Group(host, config, "run42", algorithm="diloco", rule="mean", bulk=Bulk(host, enabled=False))


async def test_a_round_this_member_went_past_without_it_is_refused_at_once_not_waited_for(tmp_path):
    """A member that finished its run (or took a later state) never takes part in an earlier
    round: a member still in it that asks for its slice, or sends it a part, hears so at once
    instead of waiting out the round's timeout (the stall of learning_robust, 2026-11-27)."""
    import trio

    group = _patient_group(tmp_path)
    group.round = 3
    with trio.fail_after(1):
        with pytest.raises(Unavailable, match="round 2 is over here"):
            await _drain(group.serve_reduced(PEER, {"group": "run42", "key": [2, 0]}))
        with pytest.raises(Unavailable, match="round 2 is over here"):
            await group.serve_part(PEER, {"group": "run42", "key": [2, 0], "roster": b"\0" * 32, "index": 0},
                                   items=None)
    assert not group._exchanges  # nothing kept for it


async def _items(*frames):
    for frame in frames:
        yield frame


async def test_a_tensor_set_is_taken_only_from_its_author_at_the_other_end(tmp_path):
    """A receiver does not hash the tensors against the signed digest (the channel to the
    author authenticates every byte), so it must refuse, before reading any tensor, a set
    whose author is not the peer sending it, even one its author really signed, or one
    whose signature is not its author's."""
    from learn.wire import Contribution

    group = _patient_group(tmp_path)
    author, sender = Identity.generate(), Identity.generate()
    contribution = Contribution("run42", 0, author.peer_id.key, "params", 1, b"\1" * 32)
    relayed = {"contribution": contribution.to_wire(), "signature": contribution.sign(author.sign)}
    with pytest.raises(InvalidArgument, match="not signed by its sender"):
        await group._receive(sender.peer_id, _items(relayed), kind="params")
    forged = {"contribution": contribution.to_wire(), "signature": contribution.sign(sender.sign)}
    with pytest.raises(InvalidArgument, match="not signed by its sender"):
        await group._receive(author.peer_id, _items(forged), kind="params")
    assert author.peer_id.key not in group.view.members  # nothing from either counts as hearing the author
