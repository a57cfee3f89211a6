"""The endpoint's inbox: datagrams served a connection at a time, bounded in bytes (meshd/transport/inbox.py)."""

from meshd.transport.inbox import FairInbox

ADDR = ("127.0.0.1", 4100)


def datagrams(key: str, n: int, size: int = 10) -> list[bytes]:
    return [f"{key}{i}".encode().ljust(size, b".") for i in range(n)]


def test_a_connection_waits_behind_one_datagram_of_each_other_not_behind_their_backlog():
    inbox = FairInbox(1 << 20)
    for data in datagrams("a", 50):
        inbox.put("a", data, ADDR)
    inbox.put("b", b"b0", ADDR)
    inbox.put(None, b"stray", ADDR)
    assert [data for data, _ in inbox.take(3)] == [datagrams("a", 1)[0], b"b0", b"stray"]
    assert [data for data, _ in inbox.take(100)] == datagrams("a", 50)[1:]  # in order within a connection
    assert not inbox and inbox.bytes == 0


def test_each_take_goes_on_where_the_last_one_stopped():
    inbox = FairInbox(1 << 20)
    for key in "abc":
        for data in datagrams(key, 2):
            inbox.put(key, data, ADDR)
    first = [data[:1] for data, _ in inbox.take(2)]
    second = [data[:1] for data, _ in inbox.take(4)]
    assert first + second == [b"a", b"b", b"c", b"a", b"b", b"c"]


def test_a_round_is_one_datagram_of_each_busy_connection_or_a_batch_of_a_lone_one():
    inbox = FairInbox(1 << 20)
    for key in "ab":
        for data in datagrams(key, 20):
            inbox.put(key, data, ADDR)
    inbox.put("quiet", b"ping", ADDR)
    assert [data[:1] for data, _ in inbox.take_round(16)] == [b"a", b"b", b"p"]  # not 16 of the backlogs
    assert len(inbox.take_round(16)) == 2  # the quiet one is served; the two backlogs go on a datagram each
    for _ in range(18):
        inbox.take_round(16)
    assert not inbox
    for data in datagrams("a", 20):
        inbox.put("a", data, ADDR)
    assert [data for data, _ in inbox.take_round(16)] == datagrams("a", 16)  # alone: a whole batch


def test_past_its_bound_the_longest_queue_loses_its_newest():
    inbox = FairInbox(max_bytes=100)
    flood = datagrams("a", 12)  # 120 bytes: two past the bound
    for data in flood[:9]:
        inbox.put("a", data, ADDR)
    inbox.put("b", b"b".ljust(10, b"."), ADDR)  # 100 bytes in all: still within
    assert inbox.dropped == 0
    for data in flood[9:]:
        inbox.put("a", data, ADDR)
    assert inbox.dropped == 3 and inbox.bytes == 100
    taken = [data for data, _ in inbox.take(100)]
    assert taken[:2] == [flood[0], b"b".ljust(10, b".")]
    assert taken[2:] == flood[1:9]  # the three newest of the flood went, the other queue kept its own
