"""The document service's config section, ``[crdt]``."""

from __future__ import annotations

from dataclasses import dataclass, field

from crdt.change import MAX_CHANGE, MAX_OPS


@dataclass
class CrdtSection:
    sync_interval: float = 10.0  # seconds between anti-entropy syncs of each document
    discover_interval: float = 60.0  # seconds between provider lookups for a document's replicas
    max_peers: int = 16  # replicas a document syncs and pushes with
    join_timeout: float = 10.0  # seconds opening another node's document waits for a first sync
    compact_every: int = 10_000  # changes between snapshots of a document
    max_pending: int = 10_000  # early changes held per document while their dependencies arrive
    peer_rate: float = 2000.0  # new changes per second one peer may send (each costs a signature check)
    peer_burst: int = 20_000  # ... and at once, e.g. a whole document to a new replica
    # bytes of one change, made here or taken from a peer (at most 8 MiB: a change must fit an RPC frame)
    max_change: int = field(default=MAX_CHANGE, metadata={"min": 1024, "max": 8 << 20})
    max_ops: int = field(default=MAX_OPS, metadata={"min": 1, "max": 100_000})  # operations in one change
