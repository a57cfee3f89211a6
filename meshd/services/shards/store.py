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
store's back is noticed by get or ``missing(verify=True)``.)

get keeps access times in memory; they reach the index at gc and close, so reads cost no
fsync.  gc evicts least recently used unpinned chunks first.

One process per ``root``.  Not thread-safe, but any one thread at a time may make a call
(``trio.to_thread.run_sync``): the connection is opened with ``check_same_thread=False``.
"""

from __future__ import annotations

import os
import functools
import sqlite3
import threading
import time
from contextlib import contextmanager
from itertools import repeat
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import blake3

from .format import ChunkError  # also: bytes that do not hash to the id given, an id not 32 bytes

ID_LEN = 32

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
        self._lock = threading.RLock()  # one caller at a time, from any thread
        self._recover()
        self._total = self._count()

    @_locked
    def close(self) -> None:
        """Write the access times kept in memory, and close the index."""
        self._flush_atimes()
        self._db.close()

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

    @_locked
    def put(self, cid: bytes, data: bytes) -> bool:
        """Store ``data`` as chunk ``cid``; durable when this returns True.

        Returns False (storing nothing) if the chunk was here already.  Raises ChunkError if
        ``blake3(data) != cid``; StoreFull if the pinned chunks leave no room for it under
        ``max_bytes`` (then nothing is evicted), else gc evicts unpinned chunks to make room.
        """
        _check_id(cid)
        if (actual := chunk_id(data)) != cid:
            raise ChunkError(f"chunk {cid.hex()}: the data hashes to {actual.hex()}")
        path = self._path(cid)
        size = self.size_of(cid)
        if size is not None:
            if path.exists():
                self._touched[cid] = time.time_ns()
                return False
            self._remove([(cid, size)])  # the file was deleted behind our back
        if self._total + len(data) > self.max_bytes:
            pinned = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM chunks"
                                      f" WHERE pending = 0 AND {_PINNED}").fetchone()[0]
            if pinned + len(data) <= self.max_bytes:  # else evict nothing in vain
                self.gc(self.max_bytes - len(data))
            if self._total + len(data) > self.max_bytes:
                raise StoreFull(f"{len(data)} bytes do not fit: {pinned} of {self.max_bytes} pinned")
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, 1)",
                       (cid, len(data), time.time_ns()))
        if not path.parent.exists():
            path.parent.mkdir()
            _fsync_dir(self.root)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise  # the row stays pending: the next gc or open settles it
        _fsync_dir(path.parent)
        with self._tx() as db:
            db.execute("UPDATE chunks SET pending = 0 WHERE id = ?", (cid,))
        self._total += len(data)
        return True

    def _load(self, cid: bytes, verify: bool) -> bytes | None:
        size = self.size_of(cid)
        if size is None:
            return None
        data = _read(self._path(cid))
        if data is None or len(data) != size or (verify and chunk_id(data) != cid):
            self._remove([(cid, size)])
            return None
        return data

    @_locked
    def get(self, cid: bytes, *, verify: bool = True) -> bytes | None:
        """The chunk's bytes, or None if we lack it.

        With ``verify`` (the default) the bytes are re-hashed.  A chunk whose file is
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
