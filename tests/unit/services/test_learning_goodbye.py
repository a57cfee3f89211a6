"""A member's goodbye (``learning.bye``) as the group that hears it keeps it: the leaver is
dropped and not greeted again on others' word; a hello it sent before the goodbye does not
bring it back, one from a later round or a fresh start does."""

import pytest
import trio
from fakehost import FakeHost

from meshd.identity import Identity
from meshd.rpc import InvalidArgument
from meshd.services.learning import LearningSection
from meshd.services.learning.bulk import Bulk
from meshd.services.learning.group import Group

LEAVER = Identity.generate().peer_id


def _group(tmp_path) -> Group:
    host = FakeHost(tmp_path)
    group = Group(host, LearningSection(), "run42", algorithm="diloco", rule="mean", bulk=Bulk(host, enabled=False))
    group.hello_from(LEAVER, {"round": 4, "joined": 0})
    return group


async def test_a_goodbye_drops_the_member_and_others_naming_it_do_not_bring_it_back(tmp_path):
    group = _group(tmp_path)
    assert group.live() == sorted([group.me, LEAVER.key])
    group.serve_bye(LEAVER, {"group": "run42", "round": 5})
    assert group.live() == [group.me] and LEAVER.key not in group.view.members
    group.heard_of(LEAVER.key)  # another member's hello or the DHT still names it
    assert LEAVER.key not in group.to_greet()


@pytest.mark.parametrize("hello, back", [
    ({"round": 5, "joined": 0}, False),  # sent before its goodbye (round 5 was its last word)
    ({"round": 6, "joined": 0}, True),  # working on a later round: it came back
    ({"round": 0, "joined": None}, True),  # a fresh start, before it has the group's state
])
async def test_a_hello_after_a_goodbye_counts_only_from_a_later_round_or_a_fresh_start(tmp_path, hello, back):
    group = _group(tmp_path)
    group.serve_bye(LEAVER, {"group": "run42", "round": 5})
    group.hello_from(LEAVER, hello)
    assert (LEAVER.key in group.view.members) is back


async def test_a_goodbye_names_a_round(tmp_path):
    group = _group(tmp_path)
    for arg in ({"group": "run42"}, {"group": "run42", "round": -1}, {"group": "run42", "round": "5"}):
        with pytest.raises(InvalidArgument):
            group.serve_bye(LEAVER, arg)
    assert LEAVER.key in group.view.members
