"""The chunk store: round trips, hash checks, dedup, batches and streams (bounded memory,
pins before room is made), pins shared between models, gc and its limits, corruption on
disk (a writer killed mid-put or mid-stream: tests/daemon/test_stores_survive_sigkill.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from meshd.services.shards import store as store_module
from meshd.services.shards.store import ONCE, ChunkError, ChunkStore, StoreFull, chunk_id

M1, M2 = b"\x01" * 32, b"\x02" * 32


def make(i: int, size: int = 1000) -> tuple[bytes, bytes]:
    """A distinct chunk (id, data) of ``size`` bytes."""
    data = (b"chunk%07d" % i * (size // 12 + 1))[:size]
    return chunk_id(data), data


def files(root: Path) -> dict[str, Path]:
    """Every file in the chunk folders, by name."""
    return {p.name: p for p in root.glob("??/*")}


@pytest.fixture
def root(tmp_path):
    return tmp_path / "chunks"


@pytest.fixture
def store(root):
    s = ChunkStore(root, max_bytes=1 << 30)
    yield s
    s.close()


def test_round_trip(store, root):
    (a, da), (b, db), (c, _) = make(1), make(2, 5000), make(3)
    assert store.put(a, da) is True
    assert store.put(b, db) is True
    assert store.get(a) == da and store.get(b, verify=False) == db
    assert store.has(a) and not store.has(c) and store.get(c) is None
    assert store.size_of(b) == 5000 and store.size_of(c) is None
    assert store.total_bytes() == 6000
    assert store.missing([c, a, b, c]) == [c]
    assert (root / a.hex()[:2] / a.hex()).read_bytes() == da


def test_hash_mismatch_refused(store, root):
    (a, da), (b, _) = make(1), make(2)
    with pytest.raises(ChunkError):
        store.put(b, da)
    with pytest.raises(ValueError):  # ChunkError is a ValueError
        store.put(a[:31], da)
    assert not store.has(b) and store.total_bytes() == 0 and files(root) == {}


def test_duplicate_put_stores_once(store, root):
    a, da = make(1)
    assert store.put(a, da) is True
    assert store.put(a, da) is False
    assert store.total_bytes() == 1000
    assert list(files(root)) == [a.hex()]


def test_put_many_stores_a_batch_once_each(store, root):
    chunks = [make(i) for i in range(5)]
    assert store.put(*chunks[0]) is True
    assert store.put_many([*chunks, chunks[3]]) == 4  # the one already here and the repeat are not new
    assert all(store.get(cid) == data for cid, data in chunks)
    assert set(files(root)) == {cid.hex() for cid, _ in chunks} and store.total_bytes() == 5000
    with pytest.raises(ChunkError):  # one bad chunk: none of the batch is stored
        store.put_many([make(10), (make(11)[0], make(12)[1])])
    assert not store.has(make(10)[0]) and store.total_bytes() == 5000
    assert store.put_many([make(10), (make(11)[0], make(12)[1])], hashed=True) == 2  # trusted, as told


def test_put_many_pins_before_it_makes_room(root):
    store = ChunkStore(root, max_bytes=4000)
    old = [make(i) for i in range(4)]
    store.put_many(old)
    store.pin(M1, [], "publishing")
    assert store.put_many([make(10), make(11)], pin=M1) == 2  # room: the two oldest go
    assert store.put_many([old[2], make(12)], pin=M1) == 1  # room for one: old[3], not old[2] it pins
    assert store.missing([c for c, _ in old]) == [old[0][0], old[1][0], old[3][0]]
    with pytest.raises(StoreFull):  # all of it pinned
        store.put_many([make(13)], pin=M1)
    store.unpin(M1)
    assert store.put_many([make(13)]) == 1
    store.close()


def test_put_stream_stores_in_order_with_bounded_memory(store):
    chunks = [make(i, 3000)[1] for i in range(40)]
    stored, held = [], []
    stage = store._stage

    def slow_stage(group, batch, **kwargs):  # a slow disk
        time.sleep(0.002)
        stored.extend(data for _, data in batch)
        return stage(group, batch, **kwargs)

    def produce():
        for i, data in enumerate(chunks):
            held.append(sum(map(len, chunks[:i])) - sum(map(len, stored)))  # made, not yet written
            yield bytearray(data)

    store._stage = slow_stage
    ids = store.put_stream(produce(), window=10_000)
    assert ids == [chunk_id(c) for c in chunks] and all(store.get(i) == c for i, c in zip(ids, chunks))
    assert max(held) <= 10_000 + 3000 and len(stored) == 40


def test_put_stream_raises_what_failed_and_stops(root):
    def produce(n, fail=False):
        for i in range(n):
            yield make(i)[1]
        if fail:
            raise ValueError("the file got shorter")

    with ChunkStore(root, max_bytes=10_000) as store:
        with pytest.raises(ValueError, match="shorter"):
            store.put_stream(produce(3, fail=True))
        assert store.missing([make(i)[0] for i in range(3)]) == []  # what came before the failure is stored
        made = produce(1000)
        with pytest.raises(StoreFull):
            store.pin(M1, [], "publishing")
            store.put_stream(made, pin=M1, window=2000)
        assert len(list(made)) > 900  # the producer stopped soon after the writer failed


def test_a_writer_acknowledges_chunks_once_durable_a_group_at_a_time(store, root, monkeypatch):
    """What a fetch relies on: ``on_durable`` names chunks only once they are stored under
    their final names and in the index (so a progress report never runs ahead of the
    disk), every chunk handed over exactly once (one that was here already too), in
    groups of at most STREAM_GROUP bytes, and all of them by the time close returns."""
    monkeypatch.setattr(store_module, "STREAM_GROUP", 10_000)
    chunks = [make(i, 3000) for i in range(20)]
    store.put(*chunks[5])
    acked, groups = [], []

    def on_durable(ids):
        assert store.missing(ids) == [] and all((root / c.hex()[:2] / c.hex()).exists() for c in ids)
        assert sum(store.size_of(c) for c in ids) <= 10_000 + 3000 * 4  # a group stops once past it
        acked.extend(ids)
        groups.append(len(ids))

    with store.writer(window=12_000, on_durable=on_durable) as writer:
        for cid, data in chunks:
            writer.put(cid, data)
    assert sorted(acked) == sorted(cid for cid, _ in chunks) and len(groups) >= 20 * 3000 // (10_000 + 12_000)
    assert store.total_bytes() == 20 * 3000


def test_a_writer_that_failed_says_so(root):
    with ChunkStore(root, max_bytes=5000) as store:
        store.pin(M1, [], "fetching")
        writer = store.writer(pin=M1, window=2000)
        with pytest.raises(StoreFull):
            for i in range(100):
                writer.put(*make(i))
        with pytest.raises(StoreFull):
            writer.close()
        assert store.total_bytes() == 5000  # what was made durable before stays


def test_models_sharing_chunks(store):
    ids = [make(i) for i in range(6)]
    for cid, data in ids:
        store.put(cid, data)
    c = [cid for cid, _ in ids]
    store.pin(M1, [c[0], c[1], c[2], c[2]], "alpha")
    store.pin(M2, [c[2], c[3], make(99)[0]], "beta", sizes=[1000, 1000, 4000])
    assert store.pins() == [(M1, "alpha", 3, 3000, 3000), (M2, "beta", 3, 6000, 2000)]
    assert store.gc() == (2, 2000)  # c4, c5: pinned by nobody
    assert store.unpin(M1) is True and store.unpin(M1) is False
    assert store.gc() == (2, 2000)  # c0, c1; c2 stays, beta pins it
    assert [store.has(x) for x in c] == [False, False, True, True, False, False]
    assert store.pins() == [(M2, "beta", 3, 6000, 2000)]
    assert store.total_bytes() == 2000


def test_pins_survive_reopen(root):
    with ChunkStore(root, max_bytes=1 << 20) as s:
        a, da = make(1)
        s.put(a, da)
        s.pin(M1, [a, make(2)[0]], "kept")
    with ChunkStore(root, max_bytes=1 << 20) as s:
        assert s.pins() == [(M1, "kept", 2, 1000, 1000)]
        assert s.gc() == (0, 0)
        assert s.get(a) == da


def test_gc_target_least_recently_used_first(store):
    c = [make(i) for i in range(5)]
    for cid, data in c:
        store.put(cid, data)
    store.get(c[0][0])
    store.get(c[1][0])
    assert store.gc(2500) == (3, 3000)
    assert [store.has(cid) for cid, _ in c] == [True, True, False, False, False]
    assert store.gc(2000) == (0, 0)
    assert store.total_bytes() == 2000


def test_store_full_when_pinned_data_exceeds_max(root):
    with ChunkStore(root, max_bytes=3500) as s:
        c = [make(i) for i in range(4)]
        s.pin(M1, [cid for cid, _ in c])
        for cid, data in c[:3]:
            s.put(cid, data)
        cached, data = make(8, 500)
        s.put(cached, data)
        with pytest.raises(StoreFull):
            s.put(*c[3])
        with pytest.raises(StoreFull):
            s.put(*make(9, 3501))
        assert s.has(cached)  # a refused put evicts nothing in vain
        assert s.missing([cid for cid, _ in c]) == [c[3][0]]
        assert s.total_bytes() == 3500 and len(files(root)) == 4
        s.unpin(M1)
        assert s.put(*c[3]) is True and s.total_bytes() <= 3500


def test_put_makes_room_by_gc(root):
    with ChunkStore(root, max_bytes=3000) as s:
        c = [make(i) for i in range(5)]
        for cid, data in c[:3]:
            s.put(cid, data)
        s.pin(M1, [c[0][0]])
        assert s.put(*c[3]) is True  # evicts c1: unpinned and least recently used
        assert [s.has(cid) for cid, _ in c[:4]] == [True, False, True, True]
        assert s.put(*make(7, 2000)) is True  # evicts c2 and c3
        assert s.total_bytes() == 3000 and s.has(c[0][0])


def test_corrupted_chunk_detected(store, root):
    (a, da), (b, db) = make(1), make(2)
    store.put(a, da)
    store.put(b, db)
    for cid in (a, b):
        path = root / cid.hex()[:2] / cid.hex()
        raw = bytearray(path.read_bytes())
        raw[500] ^= 0x01
        path.write_bytes(raw)
    assert store.get(a) is None
    assert not (root / a.hex()[:2] / a.hex()).exists()
    assert not store.has(a) and store.missing([a, b]) == [a]
    assert store.missing([a, b], verify=True) == [a, b]  # reads b, finds it corrupted too
    assert files(root) == {} and store.total_bytes() == 0
    assert store.put(a, da) is True and store.get(a) == da


def test_serving_reads_rehash_a_chunk_once_per_store(root):
    """get(verify=ONCE), what serves peers (who verify every chunk themselves): a chunk this
    store wrote, or has re-hashed since it was opened, is not hashed again; after a reopen
    each chunk's first read is, and a damaged one is deleted then."""
    (a, da), (b, db) = make(1), make(2)

    def damage(cid):
        path = root / cid.hex()[:2] / cid.hex()
        raw = bytearray(path.read_bytes())
        raw[10] ^= 1
        path.write_bytes(raw)

    with ChunkStore(root, max_bytes=1 << 20) as store:
        store.put(a, da)
        store.put(b, db)
        damage(a)
        assert store.get(a, verify=ONCE) != da  # written here: sent as it is (the fetcher catches it)
        assert store.get(a) is None and not store.has(a)  # a full check still does
    with ChunkStore(root, max_bytes=1 << 20) as store:
        assert store.get(b, verify=ONCE) == db  # first read since opening: re-hashed
        damage(b)
        assert store.get(b, verify=ONCE) != db  # known good since then: not re-hashed
    with ChunkStore(root, max_bytes=1 << 20) as store:
        assert store.get(b, verify=ONCE) is None and not store.has(b)  # first read again: caught


def test_failed_write_leaves_nothing(store, root, monkeypatch):
    a, da = make(1)

    def fail(src, dst):
        raise OSError("disk on fire")
    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        store.put(a, da)
    monkeypatch.undo()
    assert not store.has(a) and files(root) == {} and store.total_bytes() == 0
    assert store.gc() == (0, 0)
    assert store.put(a, da) is True and store.get(a) == da
