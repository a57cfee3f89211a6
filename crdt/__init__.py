"""Replicated documents: CRDT types, signed hash-linked changes, access rules,
range-based reconciliation and SQLite persistence.

A library on its own: it never imports meshd, cli, dht or nat.  It does no
I/O besides :class:`Store`'s file: a :class:`Document` takes changes in and
makes new ones, a :class:`Reconciler` turns messages into replies, and
:func:`sync_session` runs one sync over any :class:`Channel` (meshd's is a
bidi RPC call, the tests' an in-memory pair).
"""

from .change import Change, ChangeError, decode_change, sign_change
from .document import ANYONE, Acl, Document, Rejected, Transaction, doc_id
from .reconcile import ItemSet, Reconciler, ReconcileError
from .session import Channel, SyncResult, sync_session
from .store import Store
from .types import GCounter, LWWRegister, MVRegister, ORMap, ORSet, PNCounter

__all__ = [
    "ANYONE", "Acl", "Change", "ChangeError", "Channel", "Document", "GCounter", "ItemSet", "LWWRegister",
    "MVRegister", "ORMap", "ORSet", "PNCounter", "ReconcileError", "Reconciler", "Rejected", "Store",
    "SyncResult", "Transaction", "decode_change", "doc_id", "sign_change", "sync_session",
]
