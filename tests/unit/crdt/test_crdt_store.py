"""The SQLite store: save/load round trips, compaction, the access rule across
compaction and atomicity of its writes (acknowledged changes surviving ``kill -9``
of the writer: tests/daemon/test_stores_survive_sigkill.py)."""

from __future__ import annotations

import random
import sqlite3

import pytest

from crdt import change as ops
from crdt.change import Change, ChangeError, decode_change
from crdt.document import Document, Rejected
from crdt.store import Store
from crdt_helpers import Key, assert_converged, commit, deliver, forge, reconcile, snapshot_of, via_wire

NAME = "run42"
OWNER, W1, W2 = Key("owner"), Key("writer-1"), Key("writer-2")
STRANGER = Key("stranger")


def new_doc(name: str = NAME, **options) -> Document:
    return Document(OWNER.pk, name, **options)


class Writer:
    """A document kept in a store, written the way meshd does: prepare, save, receive."""

    def __init__(self, store: Store, doc: Document):
        self.store, self.doc = store, doc
        self.changes: list[Change] = []  # in the order applied
        store.add_document(doc)

    def write(self, key: Key, fill) -> Change:
        tx = self.doc.transaction()
        fill(tx)
        change = self.doc.prepare(tx, key.pk, key.sign, len(self.changes))
        self.store.save(self.doc, [change])
        assert self.doc.receive(change) == [change]
        self.changes.append(change)
        return change

    def ingest(self, changes) -> list[Change]:
        """Changes from a peer: apply, then save what was applied."""
        applied = []
        for change in changes:
            applied += self.doc.receive(via_wire(change))
        self.store.save(self.doc, applied)
        self.changes += applied
        return applied


def busy_history(w: Writer, rounds: int = 3) -> None:
    """Every kind of operation, by three keys, with grants, revokes and deletes."""
    w.write(OWNER, lambda tx: (tx.grant(W1.pk), tx.grant(W2.pk), tx.grant(STRANGER.pk, "reader")))
    for n in range(rounds):
        w.write(W1, lambda tx: (tx.set(["cfg", "lr"], 0.1 * (n + 1)), tx.inc(["step"], 10),
                                tx.add(["members"], f"m{n}"), tx.assign(["note"], [n, "x"])))
        w.write(W2, lambda tx: (tx.inc(["step"], -3), tx.inc(["tokens"], 5, grow_only=True),
                                tx.remove(["members"], f"m{n - 1}"), tx.set(["cfg", "nested", "k"], n)))
        w.write(OWNER, lambda tx: (tx.delete(["cfg", "nested"]), tx.add(["tags"], b"\x00" + bytes([n]))))
    w.write(OWNER, lambda tx: tx.revoke(W2.pk))
    w.write(W1, lambda tx: tx.delete(["note"]))


def test_save_and_load_round_trip(tmp_path):
    path = tmp_path / "crdt.db"
    store = Store(path)
    w = Writer(store, new_doc())
    busy_history(w)
    # changes made elsewhere and ingested, some arriving before their dependencies
    peer = new_doc()
    deliver(peer, w.changes)
    remote = [commit(peer, W1, lambda tx, n=n: tx.add(["remote"], n)) for n in range(5)]
    w.ingest(reversed(remote))
    assert w.doc.pending == 0
    store.close()

    store = Store(path)
    assert store.documents() == [(OWNER.pk, NAME)]
    loaded = store.load(OWNER.pk, NAME)
    assert snapshot_of(loaded) == snapshot_of(w.doc)
    assert loaded.get() == w.doc.get()
    assert loaded.pending == 0 and len(loaded) == len(w.changes)
    assert loaded.acl.members("writer") == {W1.pk}
    by_key = {c.key: c for c in w.changes}
    keys = sorted(by_key)
    assert store.wires(loaded.id, keys) == [by_key[k].wire for k in keys]
    assert store.wires(loaded.id, keys[::-1][:3] + [bytes(40)]) == [by_key[k].wire for k in sorted(keys[-3:])]
    assert [decode_change(wire).id for wire in store.wires(loaded.id, keys)] == [by_key[k].id for k in keys]
    # the loaded replica keeps going
    c = commit(loaded, W1, lambda tx: tx.set(["after"], 1))
    store.save(loaded, [c])
    store.close()
    again = Store(path).load(OWNER.pk, NAME)
    assert again.get(["after"]) == 1 and snapshot_of(again) == snapshot_of(loaded)


def test_documents_are_kept_apart_and_can_be_forgotten(tmp_path):
    store = Store(tmp_path / "crdt.db")
    a, b = Writer(store, new_doc("alpha")), Writer(store, new_doc("beta"))
    a.write(OWNER, lambda tx: tx.set(["x"], "a"))
    b.write(OWNER, lambda tx: tx.set(["x"], "b"))
    store.add_document(a.doc)  # twice is fine
    assert store.documents() == [(OWNER.pk, "alpha"), (OWNER.pk, "beta")]
    assert store.load(OWNER.pk, "alpha").get() == {"x": "a"}
    store.compact(b.doc)
    store.remove_document(b.doc.id)
    assert store.documents() == [(OWNER.pk, "alpha")]
    assert len(store.load(OWNER.pk, "beta")) == 0
    assert store.load(OWNER.pk, "alpha").get() == {"x": "a"}
    assert store.wires(b.doc.id, [c.key for c in b.changes]) == []


def test_saving_twice_is_harmless(tmp_path):
    store = Store(":memory:")
    w = Writer(store, new_doc())
    c = w.write(OWNER, lambda tx: tx.inc(["n"]))
    store.save(w.doc, [c, c])
    store.save(w.doc, [])
    assert store.load(OWNER.pk, NAME).get() == {"n": 1}


def test_compaction_keeps_the_state(tmp_path):
    path = tmp_path / "crdt.db"
    store = Store(path)
    w = Writer(store, new_doc())
    busy_history(w, rounds=4)
    before = snapshot_of(w.doc)
    folded = store.compact(w.doc)
    assert folded == len(w.changes)
    assert store.compact(w.doc) == 0
    assert snapshot_of(w.doc) == before
    compacted = store.load(OWNER.pk, NAME)
    assert snapshot_of(compacted) == before
    # more after the compaction, an access change among them
    w.write(OWNER, lambda tx: tx.grant(W2.pk))
    w.write(W2, lambda tx: (tx.add(["members"], "late"), tx.inc(["step"], 100)))
    w.write(W1, lambda tx: tx.delete(["cfg"]))
    store.close()

    store = Store(path)
    loaded = store.load(OWNER.pk, NAME)
    assert snapshot_of(loaded) == snapshot_of(w.doc)
    # a fresh replay of every change, in the order they were made and shuffled
    replay = new_doc()
    deliver(replay, w.changes)
    assert snapshot_of(replay) == snapshot_of(loaded)
    shuffled = new_doc()
    changes = list(w.changes)
    random.Random(5).shuffle(changes)
    deliver(shuffled, changes)
    assert_converged([loaded, replay, shuffled])
    assert reconcile(loaded, shuffled) == (set(), set())
    # compact again on the loaded replica, then reload once more
    assert store.compact(loaded) == 3
    assert snapshot_of(store.load(OWNER.pk, NAME)) == snapshot_of(w.doc)


def test_access_rule_survives_compaction(tmp_path):
    path = tmp_path / "crdt.db"
    store = Store(path)
    w = Writer(store, new_doc())
    w.write(OWNER, lambda tx: (tx.grant(W1.pk), tx.grant(W2.pk)))
    before_revoke = w.write(W1, lambda tx: tx.inc(["n"]))
    w.write(OWNER, lambda tx: tx.revoke(W2.pk))
    w.write(W1, lambda tx: tx.inc(["n"]))
    store.compact(w.doc)
    store.close()

    store = Store(path)
    loaded = store.load(OWNER.pk, NAME)
    assert loaded.acl.members("writer") == {W1.pk}
    # the writer granted before the compaction still writes, locally and from a peer
    mine = commit(loaded, W1, lambda tx: tx.inc(["n"]))
    store.save(loaded, [mine])
    theirs = forge(loaded.id, W1, [[ops.COUNT, ["m"], 1, 0]], [mine])
    assert loaded.receive(via_wire(theirs)) == [theirs]
    # a change by the revoked writer made before it saw the revoke is still admitted
    concurrent = forge(loaded.id, W2, [[ops.SET, ["w2"], "late"]], [before_revoke])
    assert loaded.receive(via_wire(concurrent)) == [concurrent]
    # ... but not one that saw it, and never one by a stranger
    with pytest.raises(Rejected):
        loaded.receive(via_wire(forge(loaded.id, W2, [[ops.SET, ["w2"], "no"]], [theirs])))
    with pytest.raises(Rejected):
        loaded.receive(via_wire(forge(loaded.id, STRANGER, [[ops.SET, ["s"], 1]], [theirs])))
    tx = loaded.transaction()
    tx.set(["s"], 1)
    with pytest.raises(Rejected):
        loaded.prepare(tx, STRANGER.pk, STRANGER.sign, 0)
    store.save(loaded, [theirs, concurrent])
    # a replica that never compacted agrees
    replay = new_doc()
    deliver(replay, w.changes + [mine, theirs, concurrent])
    assert_converged([loaded, replay])
    store.close()
    again = Store(path).load(OWNER.pk, NAME)
    assert_converged([again, replay])


def test_compaction_is_all_or_nothing(tmp_path):
    """compact() writes the snapshot and marks the changes folded in two
    statements; the connection is in autocommit mode (isolation_level=None),
    so `with self._conn` opens no transaction and a failure (or a kill)
    between them leaves a snapshot whose access changes are not marked folded.
    Store.load then restores the snapshot without them: the writer loses its
    right, and admitting a change whose past holds the grant raises KeyError."""
    path = tmp_path / "crdt.db"
    store = Store(path)
    w = Writer(store, new_doc())
    w.write(OWNER, lambda tx: tx.grant(W1.pk))
    last = w.write(W1, lambda tx: tx.inc(["n"]))

    def deny_folding(action, arg1, arg2, db, source):
        if action == sqlite3.SQLITE_UPDATE and arg1 == "crdt_changes":
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK

    store._conn.set_authorizer(deny_folding)  # the second statement fails
    with pytest.raises(sqlite3.DatabaseError):
        store.compact(w.doc)
    store.close()

    loaded = Store(path).load(OWNER.pk, NAME)
    assert loaded.acl.members("writer") == {W1.pk}
    assert snapshot_of(loaded) == snapshot_of(w.doc)
    change = forge(loaded.id, W1, [[ops.COUNT, ["n"], 2, 0]], [last])
    assert loaded.receive(via_wire(change)) == [change]


def test_save_is_all_or_nothing(tmp_path):
    """save() promises one transaction, but in autocommit mode each row commits
    on its own: when a later row fails, the earlier ones stay (and each row
    costs its own fsync)."""
    path = tmp_path / "crdt.db"
    store = Store(path)
    doc = new_doc()
    store.add_document(doc)
    changes = [commit(doc, OWNER, lambda tx, n=n: tx.inc(["n"], n + 1)) for n in range(3)]
    other = sqlite3.connect(path)
    other.execute(f"CREATE TRIGGER refuse_third BEFORE INSERT ON crdt_changes WHEN NEW.key = "
                  f"X'{changes[2].key.hex()}' BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    other.commit()
    with pytest.raises(sqlite3.DatabaseError):
        store.save(doc, changes)
    other.execute("DROP TRIGGER refuse_third")
    other.commit()
    other.close()
    assert len(store.load(OWNER.pk, NAME)) == 0


def test_a_node_can_reopen_its_store_after_writing_on_many_heads(tmp_path):
    """With more than MAX_DEPS (64) concurrent heads, prepare() signs a change
    with 65 deps; meshd saves it and applies it, and from then on Store.load
    raises ChangeError (it decodes what it stored), so the node cannot open
    the document again.  Either prepare refuses, or the store loads."""
    path = tmp_path / "crdt.db"
    store = Store(path)
    w = Writer(store, new_doc())
    crowd = [Key(f"crowd-{n}") for n in range(ops.MAX_DEPS + 1)]
    grant = w.write(OWNER, lambda tx: [tx.grant(k.pk) for k in crowd])
    w.ingest([forge(w.doc.id, k, [[ops.SET, ["k", str(n)], n]], [grant]) for n, k in enumerate(crowd)])
    assert len(w.doc.heads) == ops.MAX_DEPS + 1
    try:
        w.write(OWNER, lambda tx: tx.set(["after"], 1))
    except ChangeError:
        return  # refusing is one fix
    store.close()
    loaded = Store(path).load(OWNER.pk, NAME)
    assert snapshot_of(loaded) == snapshot_of(w.doc)

