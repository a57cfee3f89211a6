"""Replicated documents, the service ``crdt``: the trio shell over the :mod:`crdt` library.

:class:`Crdt` keeps documents in ``DATA_DIR/crdt.sqlite``, finds their other
replicas through provider records, and syncs and pushes changes
(``crdt.sync``, ``crdt.push``); :mod:`.control` offers them to ``meshctl crdt``
and the client library (:mod:`meshd.client.crdt`).
"""

from .config import CrdtSection
from .replica import DocError, Replica, Watcher, parse_ref
from .service import DB_FILE, Crdt, Providers

__all__ = ["DB_FILE", "Crdt", "CrdtSection", "DocError", "Providers", "Replica", "Watcher", "parse_ref"]
