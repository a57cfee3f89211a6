"""The SQLite file that keeps documents: their op logs and snapshots.

WAL mode.  When :meth:`Store.save` returns, the changes survive the process
being killed; with ``durable`` (the default: a local write, acknowledged to
its writer then) they also survive the machine losing power (an fsync, as
``synchronous=FULL``).  Changes received from peers are saved without that
fsync: their authors keep them, and a replica that lost some in a power cut
gets them back at its next sync.  The next durable commit makes them durable
too.  Compaction folds the log into
a snapshot of the state, so opening a document no longer replays (and
re-reads) its whole history; the signed changes themselves stay, because
peers that are behind need them and can only trust what their authors signed.
"""

from __future__ import annotations

import os
import sqlite3
from contextlib import contextmanager
from typing import Iterable, Iterator

from .change import GRANT, REVOKE, Change, decode_change
from .document import Document

# Stored changes passed the limits of their time; loading never refuses one for a limit lowered since.
_STORED = {"max_change": 1 << 30, "max_ops": 1 << 30}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS crdt_docs (
    id BLOB PRIMARY KEY, owner BLOB NOT NULL, name TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS crdt_changes (
    doc BLOB NOT NULL, key BLOB NOT NULL, acl INTEGER NOT NULL, folded INTEGER NOT NULL DEFAULT 0,
    wire BLOB NOT NULL, PRIMARY KEY (doc, key)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS crdt_snapshots (doc BLOB PRIMARY KEY, state BLOB NOT NULL);
"""


class Store:
    """Documents in one SQLite file (``path``; ``":memory:"`` for tests)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._conn = sqlite3.connect(path, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.executescript(_SCHEMA)

    def close(self) -> None:
        self._conn.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """All the statements inside commit together (one fsync), or none do."""
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def add_document(self, doc: Document) -> None:
        """Remember that this node keeps ``doc``."""
        with self._transaction():
            self._conn.execute("INSERT OR IGNORE INTO crdt_docs VALUES (?, ?, ?)",
                               (doc.id, doc.owner, doc.name))

    def remove_document(self, doc_id: bytes) -> None:
        """Forget a document and everything stored for it."""
        with self._transaction():
            for table, column in (("crdt_docs", "id"), ("crdt_changes", "doc"), ("crdt_snapshots", "doc")):
                self._conn.execute(f"DELETE FROM {table} WHERE {column} = ?", (doc_id,))

    def documents(self) -> list[tuple[bytes, str]]:
        """``(owner, name)`` of every document kept."""
        return [(owner, name) for owner, name in
                self._conn.execute("SELECT owner, name FROM crdt_docs ORDER BY name")]

    def save(self, doc: Document, changes: Iterable[Change], *, durable: bool = True) -> None:
        """Write ``changes`` of ``doc`` in one transaction: safe from a killed process
        when this returns, and with ``durable`` from a power cut too (an fsync)."""
        self.save_many([(doc, changes)], durable=durable)

    def save_many(self, batches: Iterable[tuple[Document, Iterable[Change]]], *, durable: bool = True) -> None:
        """:meth:`save` for the changes of several documents, all in one transaction."""
        rows = [(doc.id, c.key, int(any(op[0] in (GRANT, REVOKE) for op in c.ops)), c.wire)
                for doc, changes in batches for c in changes]
        if not durable:
            self._conn.execute("PRAGMA synchronous=NORMAL")  # WAL: no fsync at commit
        try:
            with self._transaction():
                self._conn.executemany(
                    "INSERT OR IGNORE INTO crdt_changes (doc, key, acl, wire) VALUES (?, ?, ?, ?)", rows)
        finally:
            if not durable:
                self._conn.execute("PRAGMA synchronous=FULL")

    def wires(self, doc_id: bytes, keys: Iterable[bytes]) -> list[bytes]:
        """The stored changes with these sync keys (those we have), in key order."""
        keys = sorted(keys)
        out = []
        for start in range(0, len(keys), 500):
            batch = keys[start:start + 500]
            marks = ",".join("?" * len(batch))
            out += [w for (w,) in self._conn.execute(
                f"SELECT wire FROM crdt_changes WHERE doc = ? AND key IN ({marks}) ORDER BY key",
                (doc_id, *batch))]
        return out

    def load(self, owner: bytes, name: str, **options) -> Document:
        """The document as stored: its snapshot, then the changes made since, replayed.

        A stored change was checked when it arrived, under the size and op
        limits of that time; it loads whatever ``options`` limit new ones to."""
        doc = Document(owner, name, **options)
        row = self._conn.execute("SELECT state FROM crdt_snapshots WHERE doc = ?", (doc.id,)).fetchone()
        if row is not None:
            acl_changes = [decode_change(w, verify=False, **_STORED) for (w,) in self._conn.execute(
                "SELECT wire FROM crdt_changes WHERE doc = ? AND folded = 1 AND acl = 1 ORDER BY key",
                (doc.id,))]
            doc.restore(row[0], acl_changes)
        for (wire,) in self._conn.execute(
                "SELECT wire FROM crdt_changes WHERE doc = ? AND folded = 0 ORDER BY key", (doc.id,)):
            doc.receive(decode_change(wire, verify=False, **_STORED))
        return doc

    def compact(self, doc: Document) -> int:
        """Fold ``doc``'s log into a snapshot of its current state; returns the changes folded."""
        with self._transaction():
            self._conn.execute("INSERT OR REPLACE INTO crdt_snapshots VALUES (?, ?)",
                               (doc.id, doc.snapshot()))
            return self._conn.execute(
                "UPDATE crdt_changes SET folded = 1 WHERE doc = ? AND folded = 0", (doc.id,)).rowcount
