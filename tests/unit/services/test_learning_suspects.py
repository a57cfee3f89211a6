"""A member whose contributions are clipped in most rounds is reported, once, and an honest one is not."""

import logging

from fakehost import FakeHost

from meshd.services.learning import LearningSection
from meshd.services.learning.bulk import Bulk
from learn.membership import SUSPECT_AFTER
from meshd.services.learning.group import Group


def test_a_member_clipped_in_most_of_its_rounds_is_reported_once(tmp_path, caplog):
    host = FakeHost(tmp_path)
    group = Group(host, LearningSection(), "run42", algorithm="diloco", rule="trimmed_mean",
                  bulk=Bulk(host, enabled=False))
    bad, honest = b"\x01" * 32, b"\x02" * 32
    with caplog.at_level(logging.WARNING, logger="meshd.learning"):
        for round_ in range(2 * SUSPECT_AFTER):
            for member, clipped in ((bad, True), (honest, round_ == 0)):
                group.clipped[member] += clipped
                group.used[member] += 1
                group._suspect(member)
    assert group.suspects == {bad}
    reports = [r.getMessage() for r in caplog.records if "clipped in" in r.getMessage()]
    assert len(reports) == 1
    assert reports[0].startswith(f"group run42 at {host.peer_id.short()}: ")  # which member says it
