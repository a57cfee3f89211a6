"""The reason of a close as replaced is peer data: what it says was never seen, parsed with limits."""

from hypothesis import given
from hypothesis import strategies as st

from meshd.transport.connection import REPLACED_REASON, unseen_by_peer


def test_the_last_stream_and_the_unseen_below_it_are_read_back():
    assert unseen_by_peer(f"{REPLACED_REASON} (unseen 0 8) (last stream 12)") == (12, frozenset({0, 8}))
    assert unseen_by_peer(f"{REPLACED_REASON} (last stream 4)") == (4, frozenset())
    assert unseen_by_peer(f"{REPLACED_REASON} (last stream -1)") == (-1, frozenset())


def test_a_reason_that_says_none_of_it_names_nothing():
    assert unseen_by_peer("idle timeout") == (None, frozenset())
    assert unseen_by_peer("(unseen 0 8)") == (None, frozenset())


def test_numbers_too_long_to_be_stream_ids_name_nothing():
    """Python refuses int() of over 4,300 digits with an error; no stream id has over 19."""
    huge = "9" * 5000
    assert unseen_by_peer(f"{REPLACED_REASON} (last stream {huge})") == (None, frozenset())
    assert unseen_by_peer(f"{REPLACED_REASON} (unseen {huge}) (last stream 4)") == (4, frozenset())


def test_at_most_32_unseen_streams_are_read():
    many = " ".join(str(4 * i) for i in range(33))
    assert unseen_by_peer(f"x (unseen {many}) (last stream 200)") == (200, frozenset())


@given(st.text(max_size=300))
def test_any_reason_gives_an_answer_not_an_error(reason):
    last, unseen = unseen_by_peer(reason)
    assert last is None or -1 <= last < 10**19
    assert len(unseen) <= 32 and all(0 <= sid < 10**19 for sid in unseen)
