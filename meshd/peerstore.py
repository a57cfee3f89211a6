"""What a node knows about other peers, kept in SQLite (WAL) in the data dir.

For each PeerId: the addresses it can be dialed at (most recent first,
bounded), when it was last seen, the last measured round-trip time, the path
of the last connection (direct, punched, relayed), its agent string, and the
relays it says carry connections to it.  Writes are small and synchronous; WAL keeps them cheap.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from .identity import PeerId

DB_FILE = "meshd.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS peers (
    peer_id   TEXT PRIMARY KEY,
    addrs     TEXT NOT NULL DEFAULT '[]',
    last_seen REAL,
    rtt_ms    REAL,
    path      TEXT,
    agent     TEXT,
    relays    TEXT NOT NULL DEFAULT '[]'
)
"""


@dataclass
class PeerRecord:
    peer_id: PeerId
    addrs: list[str] = field(default_factory=list)  # HOST:PORT, most recent first
    last_seen: float | None = None  # unix time
    rtt_ms: float | None = None
    path: str | None = None
    agent: str | None = None
    relays: list[str] = field(default_factory=list)  # PeerIds of relays holding its reservation


class PeerStore:
    """Peer records in ``data_dir/meshd.sqlite3``."""

    def __init__(self, data_dir: Path, max_addrs: int = 8):
        self.path = data_dir / DB_FILE
        self.max_addrs = max_addrs
        self._db = sqlite3.connect(self.path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(peers)")}
        if "relays" not in columns:  # a store written before relays were recorded
            self._db.execute("ALTER TABLE peers ADD COLUMN relays TEXT NOT NULL DEFAULT '[]'")

    def close(self) -> None:
        """Flush and close the database."""
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._db.close()

    def get(self, peer_id: PeerId) -> PeerRecord | None:
        row = self._db.execute(
            "SELECT peer_id, addrs, last_seen, rtt_ms, path, agent, relays FROM peers WHERE peer_id = ?",
            (str(peer_id),),
        ).fetchone()
        return _record(row) if row else None

    def all(self) -> list[PeerRecord]:
        rows = self._db.execute(
            "SELECT peer_id, addrs, last_seen, rtt_ms, path, agent, relays FROM peers ORDER BY last_seen DESC"
        )
        return [_record(row) for row in rows]

    def add_addresses(self, peer_id: PeerId, addrs: list[str]) -> None:
        """Put ``addrs`` first in the peer's address list (deduplicated, bounded)."""
        current = self.get(peer_id)
        merged = list(dict.fromkeys(addrs + (current.addrs if current else [])))
        self._upsert(peer_id, addrs=json.dumps(merged[: self.max_addrs]))

    def set_relays(self, peer_id: PeerId, relays: list[str]) -> None:
        """Record the relays the peer says it holds reservations at (replacing the old list)."""
        self._upsert(peer_id, relays=json.dumps(relays[: self.max_addrs]))

    def seen(self, peer_id: PeerId, *, rtt_ms: float | None = None, path: str | None = None,
             agent: str | None = None) -> None:
        """Record that the peer was just heard from, with what was measured."""
        values = {"last_seen": time.time()}
        for name, value in (("rtt_ms", rtt_ms), ("path", path), ("agent", agent)):
            if value is not None:
                values[name] = value
        self._upsert(peer_id, **values)

    def _upsert(self, peer_id: PeerId, **values: object) -> None:
        names = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        updates = ", ".join(f"{n} = excluded.{n}" for n in values)
        self._db.execute(
            f"INSERT INTO peers (peer_id, {names}) VALUES (?, {marks}) "
            f"ON CONFLICT(peer_id) DO UPDATE SET {updates}",
            (str(peer_id), *values.values()),
        )


def _record(row: tuple) -> PeerRecord:
    peer_id, addrs, last_seen, rtt_ms, path, agent, relays = row
    return PeerRecord(PeerId.from_string(peer_id), json.loads(addrs), last_seen, rtt_ms, path, agent,
                      json.loads(relays))
