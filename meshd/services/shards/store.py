"""Content-addressed chunk store for model shards: chunk files plus a SQLite index.

Layout under ``root``::

    root/index.sqlite (-wal, -shm)  chunk sizes and access times, pins
    root/ab/ab12…ef                 a chunk, named by the full hex of its blake3 id, in a
                                    folder named by the id's first two hex digits
    root/ab/ab12…ef.tmp             a chunk being written (inside put, or left by a crash)

A file under a final name is always a whole chunk: put writes ``<hex>.tmp``, fsyncs it,
renames it and fsyncs the folder.  Models listing the same chunk share its one file.

Why an index beside the files: each put needs the total size, gc needs sizes and access
times, and pins must be durable anyway; SQLite (WAL, ``synchronous=FULL``) gives these
without stat-ing up to millions of files on each open.  The index is the truth for
*presence*, the files for *contents* (get re-hashes them).  They are kept in step by a
write-ahead rule: a chunk's row is committed ``pending = 1`` before its file is created or
removed, and made ``pending = 0`` (or deleted) once that is durable.  On open and at each
gc, pending rows are settled against the disk: the temp file goes, and the chunk is kept
if its final file is there and hashes right, else forgotten.  So open costs nothing per
chunk, and a crash anywhere leaves no partial chunk under a final name, no temp file after
the next open, and no row for a chunk not on disk.  (A file deleted or damaged behind the
store's back is noticed by get or ``missing(verify=True)``; by ``get(verify=ONCE)``, what
serves peers, only if this store has not hashed that file since it was opened.)

Groups.  ``put_many`` does the same for many chunks at once: their rows go pending in one
transaction, their files are written with writeback started at once (so the disk works
while the next ones are written), then fsynced together from a few threads (so the file
system commits them in few journal transactions), renamed, their folders fsynced, and their
rows cleared in one transaction.  A :class:`ChunkWriter` (``writer()``) is what a publish
(``put_stream``) and a fetch use: the caller's threads hand it hashed chunks while its own
writer thread writes them, at most ``STREAM_WINDOW`` bytes between the two (a chunk's memory
is free once its file is written), and makes up to ``STREAM_GROUP`` bytes of them durable
at once, then acknowledges them (``on_durable``).  So a model of any size is stored with
bounded memory, hashing and receiving overlap the disk, and a publish or fetch pays few
rounds of fsyncs.  A group is written under the store's lock from its first file to its
commit, so recovery (which gc runs too) and other puts never see one half done.

get keeps access times in memory; they reach the index at gc and close, so reads cost no
fsync.  gc evicts least recently used unpinned chunks first.

One process per ``root``.  Calls are serialized by a lock, so any thread may make one
(``trio.to_thread.run_sync``; a ChunkWriter's thread): the connection is opened with
``check_same_thread=False``.
"""

from __future__ import annotations

import os
import functools
import sqlite3
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from itertools import repeat
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import blake3

from .format import ChunkError  # also: bytes that do not hash to the id given, an id not 32 bytes

ID_LEN = 32
STREAM_WINDOW = 32 << 20  # bytes of chunks put_stream holds between hashing and the disk
STREAM_GROUP = 128 << 20  # bytes put_stream makes durable together (at most)
FSYNC_THREADS = 4  # put_many syncs a batch's files in parallel
ONCE = "once"  # get(verify=ONCE): re-hash a chunk's file the first time this store reads it

_PINNED = "EXISTS (SELECT 1 FROM pin_chunks p WHERE p.chunk = chunks.id)"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    id BLOB PRIMARY KEY, size INTEGER NOT NULL, atime INTEGER NOT NULL,
    pending INTEGER NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS chunks_pending ON chunks(id) WHERE pending = 1;
CREATE TABLE IF NOT EXISTS pins (model BLOB PRIMARY KEY, name TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS pin_chunks (
    chunk BLOB NOT NULL, model BLOB NOT NULL, size INTEGER,
    PRIMARY KEY (chunk, model)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS pin_chunks_model ON pin_chunks(model);
"""


class StoreFull(Exception):
    """No room for a chunk even after removing every unpinned chunk."""


def chunk_id(data: bytes) -> bytes:
    """The id of a chunk: the 32-byte blake3 digest of its bytes."""
    return blake3.blake3(data).digest()


def _check_id(cid: bytes) -> None:
    if not isinstance(cid, bytes) or len(cid) != ID_LEN:
        raise ChunkError(f"an id must be {ID_LEN} bytes, not {cid!r:.80}")


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Pipe:
    """Chunks from a producer to one writer, holding at most ``window`` bytes (see
    :meth:`ChunkStore.put_stream`)."""

    def __init__(self, window: int) -> None:
        self._window, self._held = window, 0  # bytes queued or being written
        self._queue: deque[tuple[bytes, bytes]] = deque()
        self._closed = False
        self.failure: BaseException | None = None
        self._cond = threading.Condition()

    def put(self, cid: bytes, data: bytes) -> None:
        """Queue a chunk once there is room for it; raises the writer's failure, if any."""
        with self._cond:
            while self.failure is None and self._held and self._held + len(data) > self._window:
                self._cond.wait()
            if self.failure is not None:
                raise self.failure
            self._held += len(data)
            self._queue.append((cid, data))
            self._cond.notify_all()

    def take(self, limit: int, *, wait: bool = True) -> list[tuple[bytes, bytes]]:
        """The queued chunks, up to ``limit`` bytes (at least one), once there are any;
        [] once the pipe is closed and empty (or, without ``wait``, if it is empty now)."""
        with self._cond:
            while wait and not self._queue and not self._closed:
                self._cond.wait()
            batch, size = [], 0
            while self._queue and (not batch or size + len(self._queue[0][1]) <= limit):
                batch.append(self._queue.popleft())
                size += len(batch[-1][1])
            return batch

    def done(self, size: int) -> None:
        with self._cond:
            self._held -= size
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self.failure = exc
            self._queue.clear()
            self._cond.notify_all()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _start_writeback(fd: int) -> None:
    """Have the kernel start writing the file's dirty pages now, not at the fsync
    (on Linux, POSIX_FADV_DONTNEED starts writeback, then drops only clean pages)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class _Group:
    """Chunks written as temp files under pending rows, not yet durable nor counted."""

    def __init__(self) -> None:
        self.ids: dict[bytes, Path] = {}  # id -> its temp file
        self.size = 0

    @property
    def temps(self) -> list[Path]:
        return list(self.ids.values())

    def add(self, cid: bytes, tmp: Path, size: int) -> None:
        self.ids[cid] = tmp
        self.size += size

    def clear(self) -> None:
        self.ids.clear()
        self.size = 0


def _locked(method):
    """``method`` run under the store's lock: callers may be trio worker threads."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


class ChunkStore:
    """Chunks under ``root``, at most ``max_bytes`` of them in all (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, *, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.root / "index.sqlite", isolation_level=None,
                                   check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._touched: dict[bytes, int] = {}  # access times not yet written to the index
        self._known: set[bytes] = set()  # chunks whose files this store wrote or re-hashed (get ONCE)
        self._lock = threading.RLock()  # one caller at a time, from any thread
        self._fsyncs: ThreadPoolExecutor | None = None  # put_many's, made on first use
        self._recover()
        self._total = self._count()

    @_locked
    def close(self) -> None:
        """Write the access times kept in memory, and close the index."""
        self._flush_atimes()
        self._db.close()
        if self._fsyncs is not None:
            self._fsyncs.shutdown()

    def _each(self, fsync: Callable[[Path], None], paths: Iterable[Path]) -> None:
        """``fsync`` each path, several at once: the file system commits them together."""
        paths = list(paths)
        if len(paths) == 1:
            fsync(paths[0])
        elif paths:
            if self._fsyncs is None:
                self._fsyncs = ThreadPoolExecutor(FSYNC_THREADS, thread_name_prefix="chunk-fsync")
            list(self._fsyncs.map(fsync, paths))

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """The statements inside commit together and durably, or not at all."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _path(self, cid: bytes) -> Path:
        h = cid.hex()
        return self.root / h[:2] / h

    def _count(self) -> int:
        return self._db.execute("SELECT COALESCE(SUM(size), 0) FROM chunks WHERE pending = 0").fetchone()[0]

    def _recover(self) -> None:
        """Settle every pending row against the disk, removing its temp file."""
        pending = [cid for (cid,) in self._db.execute("SELECT id FROM chunks WHERE pending = 1")]
        if not pending:
            return
        keep, drop = [], []
        for cid in pending:
            path = self._path(cid)
            path.with_name(path.name + ".tmp").unlink(missing_ok=True)
            data = _read(path)
            if data is not None and chunk_id(data) == cid:
                keep.append((len(data), cid))
            else:
                path.unlink(missing_ok=True)
                drop.append((cid,))
        for folder in {self._path(cid).parent for cid in pending}:
            _fsync_dir(folder)
        with self._tx() as db:
            db.executemany("UPDATE chunks SET pending = 0, size = ? WHERE id = ?", keep)
            db.executemany("DELETE FROM chunks WHERE id = ?", drop)
        self._total = self._count()

    def _remove(self, victims: list[tuple[bytes, int]]) -> int:
        """Delete these ``(id, size)`` chunks, files and rows; returns the bytes freed."""
        with self._tx() as db:
            db.executemany("UPDATE chunks SET pending = 1 WHERE id = ?", [(c,) for c, _ in victims])
        freed = sum(size for _, size in victims)
        self._total -= freed
        for cid, _ in victims:
            self._path(cid).unlink(missing_ok=True)
            self._touched.pop(cid, None)
            self._known.discard(cid)
        for folder in {self._path(cid).parent for cid, _ in victims}:
            _fsync_dir(folder)
        with self._tx() as db:
            db.executemany("DELETE FROM chunks WHERE id = ?", [(c,) for c, _ in victims])
        return freed

    def _flush_atimes(self) -> None:
        if self._touched:
            with self._tx() as db:
                db.executemany("UPDATE chunks SET atime = ? WHERE id = ?",
                               [(t, c) for c, t in self._touched.items()])
            self._touched.clear()

    def put(self, cid: bytes, data: bytes) -> bool:
        """Store ``data`` as chunk ``cid``; durable when this returns True.

        Returns False (storing nothing) if the chunk was here already.  Raises ChunkError if
        ``blake3(data) != cid``; StoreFull if the pinned chunks leave no room for it under
        ``max_bytes`` (then nothing is evicted), else gc evicts unpinned chunks to make room.
        """
        return self.put_many([(cid, data)]) == 1

    @_locked
    def put_many(self, chunks: Iterable[tuple[bytes, bytes]], *, hashed: bool = False,
                 pin: bytes | None = None) -> int:
        """Store each ``(id, data)`` as :meth:`put` does; all durable when this returns.

        Returns how many were not here already.  A batch costs two index transactions and
        one round of fsyncs (the files', then the folders', issued together), however many
        chunks it holds.  ``hashed``: the caller computed each id from these very bytes
        (which must not change until this returns), so they are not hashed again.
        ``pin``: add these chunks to that model's pins (see :meth:`pin`), before any room
        is made for them, so that making room cannot evict one of them.  Raises as put
        does, before writing any chunk.
        """
        group = _Group()
        try:
            new = self._stage(group, chunks, hashed=hashed, pin=pin)
            self._commit(group)
        except BaseException:
            self._discard(group)
            raise
        return new

    def _stage(self, group: _Group, chunks: Iterable[tuple[bytes, bytes]], *, hashed: bool,
               pin: bytes | None) -> int:
        """Write the chunks not here yet as temp files under pending rows, into ``group``
        (which :meth:`_commit` makes durable, or :meth:`_discard` drops); returns how many.
        The caller holds the lock from the first stage of a group to its commit or discard."""
        batch: dict[bytes, bytes] = {}
        for cid, data in chunks:
            _check_id(cid)
            if not hashed and (actual := chunk_id(data)) != cid:
                raise ChunkError(f"chunk {cid.hex()}: the data hashes to {actual.hex()}")
            batch.setdefault(cid, data)
        if pin is not None:
            _check_id(pin)
        pins = [] if pin is None else [(cid, pin, len(data)) for cid, data in batch.items()]
        new: list[tuple[bytes, bytes]] = []
        for cid, data in batch.items():
            if cid in group.ids:
                continue
            size = self.size_of(cid)
            if size is not None:
                if self._path(cid).exists():
                    self._touched[cid] = time.time_ns()
                    continue
                self._remove([(cid, size)])  # the file was deleted behind our back
            new.append((cid, data))
        need = sum(len(data) for _, data in new)
        full = self._total + group.size + need > self.max_bytes
        if pins and (not new or full):  # pinned before any room is made
            with self._tx() as db:
                db.executemany("INSERT OR IGNORE INTO pin_chunks VALUES (?, ?, ?)", pins)
            pins = []
        if not new:
            return 0
        if full:
            self._commit(group)  # what is staged is stored, and counts, before room is made
            pinned = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM chunks"
                                      f" WHERE pending = 0 AND {_PINNED}").fetchone()[0]
            if pinned + need <= self.max_bytes:  # else evict nothing in vain
                self.gc(self.max_bytes - need)
            if self._total + need > self.max_bytes:
                raise StoreFull(f"{need} bytes do not fit: {pinned} of {self.max_bytes} pinned")
        now = time.time_ns()
        with self._tx() as db:
            db.executemany("INSERT OR IGNORE INTO pin_chunks VALUES (?, ?, ?)", pins)
            db.executemany("INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, 1)",
                           [(cid, len(data), now) for cid, data in new])
        folders = {self._path(cid).parent for cid, _ in new}
        created = [folder for folder in folders if not folder.exists()]
        for folder in created:
            folder.mkdir()
        if created:
            _fsync_dir(self.root)
        for cid, data in new:
            path = self._path(cid)
            tmp = path.with_name(path.name + ".tmp")
            group.add(cid, tmp, len(data))
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                _start_writeback(f.fileno())
        return len(new)

    def _commit(self, group: _Group) -> None:
        """Make the staged chunks durable and present: fsync the temp files, rename them,
        fsync their folders, clear their pending rows."""
        if not group.ids:
            return
        self._each(_fsync_file, group.temps)
        for tmp in group.temps:
            os.replace(tmp, tmp.with_suffix(""))
        self._each(_fsync_dir, {tmp.parent for tmp in group.temps})
        with self._tx() as db:
            db.executemany("UPDATE chunks SET pending = 0 WHERE id = ?", [(cid,) for cid in group.ids])
        self._known.update(group.ids)  # written from bytes hashed to these ids
        self._total += group.size
        group.clear()

    def _discard(self, group: _Group) -> None:
        """After a failure: remove the temp files; their rows stay pending, and the next
        gc or open settles them (a chunk renamed already is kept)."""
        for tmp in group.temps:
            tmp.unlink(missing_ok=True)
        group.clear()

    def put_stream(self, chunks: Iterable[bytes], *, pin: bytes | None = None,
                   window: int | None = None) -> list[bytes]:
        """Hash and store every chunk ``chunks`` yields, in order; returns their ids.

        For a publish: the calling thread makes (by iterating) and hashes the chunks while
        a :meth:`writer` stores them, so hashing overlaps writing and a group of up to
        ``STREAM_GROUP`` bytes costs one round of fsyncs.  Chunks waiting or being written
        hold at most ``window`` bytes (default ``STREAM_WINDOW``; or one chunk, if larger):
        memory stays bounded whatever the model's size.  Each chunk's bytes must not change
        once yielded (a new buffer per chunk).  ``pin`` as for put_many.  Raises what the
        iterator or a put raised (the chunks stored by then stay, unpinned unless ``pin``).
        """
        ids: list[bytes] = []
        writer = self.writer(pin=pin, window=window)
        try:
            for data in chunks:
                cid = chunk_id(data)
                ids.append(cid)
                writer.put(cid, data)
        except BaseException:
            writer.close(check=False)  # what the writer raised, put raised
            raise
        writer.close()
        return ids

    def writer(self, *, pin: bytes | None = None, window: int | None = None,
               on_durable: Callable[[list[bytes]], None] | None = None) -> ChunkWriter:
        """A :class:`ChunkWriter`: chunks handed to it from any thread are stored by a
        writer thread of its own in groups made durable together (see there)."""
        return ChunkWriter(self, pin=pin, window=STREAM_WINDOW if window is None else window,
                           on_durable=on_durable)

    def _drain(self, pipe: _Pipe, pin: bytes | None, batch_bytes: int,
               on_durable: Callable[[list[bytes]], None] | None) -> None:
        """The writer thread of a :class:`ChunkWriter`: stage what the pipe holds, a group
        at a time, until it is closed; after each commit, tell ``on_durable`` its ids."""
        try:
            while batch := pipe.take(batch_bytes):
                with self._lock:
                    group, seen, ids = _Group(), 0, []
                    try:
                        while batch:
                            self._stage(group, batch, hashed=True, pin=pin)
                            ids += [cid for cid, _ in batch]
                            size = sum(len(data) for _, data in batch)
                            pipe.done(size)  # written (to the page cache): its memory is free
                            seen += size
                            batch = pipe.take(batch_bytes, wait=False) if seen < STREAM_GROUP else []
                        self._commit(group)
                    except BaseException:
                        self._discard(group)
                        raise
                if on_durable is not None:
                    on_durable(ids)
        except BaseException as exc:
            pipe.fail(exc)

    def _load(self, cid: bytes, verify: bool | str) -> bytes | None:
        size = self.size_of(cid)
        if size is None:
            return None
        data = _read(self._path(cid))
        if verify == ONCE:
            verify = cid not in self._known
        if data is None or len(data) != size or (verify and chunk_id(data) != cid):
            self._remove([(cid, size)])
            return None
        if verify:
            self._known.add(cid)
        return data

    @_locked
    def get(self, cid: bytes, *, verify: bool | str = True) -> bytes | None:
        """The chunk's bytes, or None if we lack it.

        With ``verify`` (the default) the bytes are re-hashed; with ``verify=ONCE`` only
        if this store has not yet hashed this chunk's file since it was opened (it wrote
        it from bytes hashed to its id, or read and re-hashed it): what serving peers
        uses, since every fetcher hashes every chunk anyway.  A chunk whose file is found
        corrupted (or gone, or of the wrong size) is deleted and missing from then on.
        """
        data = self._load(cid, verify)
        if data is not None:
            self._touched[cid] = time.time_ns()
        return data

    @_locked
    def has(self, cid: bytes) -> bool:
        """Whether the chunk is stored (by the index; contents are checked by get)."""
        return self.size_of(cid) is not None

    @_locked
    def size_of(self, cid: bytes) -> int | None:
        """The chunk's size in bytes, or None if we lack it."""
        row = self._db.execute("SELECT size FROM chunks WHERE id = ? AND pending = 0", (cid,)).fetchone()
        return None if row is None else row[0]

    @_locked
    def total_bytes(self) -> int:
        """The bytes of all chunks stored (pinned or not)."""
        return self._total

    @_locked
    def missing(self, chunk_ids: Iterable[bytes], *, verify: bool = False) -> list[bytes]:
        """Those of ``chunk_ids`` we lack, in the order given, each once: what a fetch
        must still get.  With ``verify``, the ones we have are read and re-hashed too, and
        corrupted ones deleted and reported (slow: it reads them all)."""
        ids = list(dict.fromkeys(chunk_ids))
        have: set[bytes] = set()
        for start in range(0, len(ids), 500):
            batch = ids[start:start + 500]
            marks = ",".join("?" * len(batch))
            have.update(cid for (cid,) in self._db.execute(
                f"SELECT id FROM chunks WHERE pending = 0 AND id IN ({marks})", batch))
        if verify:
            have = {cid for cid in have if self._load(cid, True) is not None}
        return [cid for cid in ids if cid not in have]

    @_locked
    def pin(self, model_id: bytes, chunk_ids: Sequence[bytes], name: str = "", *,
            sizes: Sequence[int] | None = None) -> None:
        """Keep every chunk of ``chunk_ids`` from gc while this model is pinned; durable.

        Pinning a model again replaces its list.  ``sizes`` (one per chunk id) lets pins()
        report the model's size before all of it is here.  Pin a model before fetching it,
        so that gc making room for one of its chunks cannot evict another.
        """
        _check_id(model_id)
        for cid in chunk_ids:
            _check_id(cid)
        if sizes is not None and len(sizes) != len(chunk_ids):
            raise ValueError("need one size per chunk id")
        rows = zip(chunk_ids, repeat(model_id), repeat(None) if sizes is None else sizes)
        with self._tx() as db:
            db.execute("DELETE FROM pin_chunks WHERE model = ?", (model_id,))
            db.execute("INSERT OR REPLACE INTO pins VALUES (?, ?)", (model_id, name))
            db.executemany("INSERT OR IGNORE INTO pin_chunks VALUES (?, ?, ?)", rows)

    @_locked
    def unpin(self, model_id: bytes) -> bool:
        """Let gc remove the model's chunks that no other pin lists; durable.  Returns
        whether it was pinned."""
        with self._tx() as db:
            db.execute("DELETE FROM pin_chunks WHERE model = ?", (model_id,))
            return db.execute("DELETE FROM pins WHERE model = ?", (model_id,)).rowcount > 0

    @_locked
    def pins(self) -> list[tuple[bytes, str, int, int, int]]:
        """``(model_id, name, chunks, bytes, present_bytes)`` for each pinned model, by name.

        ``chunks`` counts distinct chunk ids; ``bytes`` sums the sizes given to pin (a chunk
        pinned without a size counts its stored size, or 0 while absent); ``present_bytes``
        sums the sizes of the chunks stored now.
        """
        return [tuple(row) for row in self._db.execute(
            "SELECT p.model, p.name, COUNT(pc.chunk), COALESCE(SUM(COALESCE(pc.size, c.size)), 0),"
            " COALESCE(SUM(c.size), 0) FROM pins p"
            " LEFT JOIN pin_chunks pc ON pc.model = p.model"
            " LEFT JOIN chunks c ON c.id = pc.chunk AND c.pending = 0"
            " GROUP BY p.model ORDER BY p.name, p.model")]

    @_locked
    def gc(self, target_bytes: int | None = None) -> tuple[int, int]:
        """Remove unpinned chunks, least recently used first, until ``total_bytes() <=
        target_bytes`` or none is left (all of them if ``target_bytes`` is None); first
        settles what a crash left behind (temp files, half-done puts and removals).
        Returns ``(chunks_removed, bytes_freed)``.
        """
        self._recover()
        self._flush_atimes()
        rows = self._db.execute(
            f"SELECT id, size FROM chunks WHERE pending = 0 AND NOT {_PINNED} ORDER BY atime")
        victims, total = [], self._total
        for cid, size in rows:
            if target_bytes is not None and total <= target_bytes:
                break
            victims.append((cid, size))
            total -= size
        rows.close()
        return len(victims), (self._remove(victims) if victims else 0)


class ChunkWriter:
    """Chunks handed over (:meth:`put`, from any thread) and stored by a writer thread:
    what a publish (:meth:`ChunkStore.put_stream`) and a fetch use.

    The writer stages what was handed over, batches of up to half the ``window`` at a
    time (temp files under pending rows, writeback started, as put_many does), and makes
    them durable together every ``STREAM_GROUP`` bytes, or whenever it has caught up with
    what was handed over (so it never holds the store's lock while waiting for more): a
    group costs one round of fsyncs.  Then it calls ``on_durable`` (in its thread) with
    the group's ids, each of them now stored and durable (a chunk that was here already
    included): that is when a chunk is *acknowledged*, never before.  Chunks handed over
    and not yet written hold at most ``window`` bytes (or one chunk, if larger).

    The caller hashed each chunk (it is stored under the id given, unchecked: verify
    first).  Its bytes must not change once handed over.
    """

    def __init__(self, store: ChunkStore, *, pin: bytes | None, window: int,
                 on_durable: Callable[[list[bytes]], None] | None) -> None:
        self._pipe = _Pipe(window)
        self._thread = threading.Thread(target=store._drain, args=(self._pipe, pin, window // 2, on_durable),
                                        name="chunk-store-writer", daemon=True)
        self._thread.start()

    def put(self, cid: bytes, data: bytes | bytearray) -> None:
        """Hand over chunk ``cid`` (hashed by the caller), once the window has room for it
        (this blocks until then).  Raises what made the writer fail, if it did."""
        self._pipe.put(cid, data)

    def close(self, *, check: bool = True) -> None:
        """Wait until everything handed over is durable (and acknowledged), then end the
        writer; with ``check``, raises what made it fail (the chunks acknowledged by then
        stay)."""
        self._pipe.close()
        self._thread.join()
        if check and self._pipe.failure is not None:
            raise self._pipe.failure

    def __enter__(self) -> ChunkWriter:
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(check=kind is None)
