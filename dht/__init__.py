"""Kademlia DHT: ids, routing table, lookups, signed records, providers.

A library on its own: it never imports meshd, cli, crdt or nat.  Peers are
reached through the small :class:`~dht.network.Network` interface, which
meshd implements over its RPC layer and :mod:`dht.simnet` in memory.
"""

from .ids import Contact, ContactError, key_id, node_id
from .network import DhtError, Network, RateLimited, Refused, Unreachable
from .node import DhtConfig, DhtNode
from .records import Record, RecordError, owned_key
from .validators import Validators
from .storage import Database, StoreFull

__all__ = [
    "Contact", "ContactError", "Database", "DhtConfig", "DhtError", "DhtNode", "Network",
    "RateLimited", "Record", "RecordError", "Refused", "StoreFull", "Unreachable", "Validators", "key_id",
    "node_id", "owned_key",
]
