"""A replicated document: its state, the index of its op log, and its access rule.

Sans-IO: a :class:`Document` takes changes in (:meth:`Document.receive`) and
makes new ones (:meth:`Document.prepare`), and never touches a disk or a
socket.  A change is applied only once every change it depends on has been;
early arrivals wait in a bounded buffer.  Whether a change is admitted depends
only on the change and its causal past (its author must be a writer in the
access rule its dependencies had), so every replica decides alike, whatever
order changes arrive in.

An author that signs two different changes at the same position (the same
Lamport clock) is an *equivocator*: both changes are kept and applied like
any two concurrent changes, so replicas still converge, and the author is
reported in :attr:`Document.equivocators`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import blake3
import msgpack

from . import change as ops
from .change import Change, ChangeError, check_element, check_path, check_value, dot_of, sign_change
from .reconcile import ItemSet
from .types import GCOUNTER, LWW, MAP, MV, PNCOUNTER, SET, Dot, ORMap, ORSet

ANYONE = bytes(32)  # as a reader key: everyone may read
MAX_NAME = 128  # bytes of a document name
_OP_KINDS = {ops.SET: LWW, ops.ASSIGN: MV, ops.GROW: GCOUNTER, ops.COUNT: PNCOUNTER,
             ops.ADD: SET, ops.REMOVE: SET}
_NAMES_DOTS = (ops.ASSIGN, ops.ADD, ops.REMOVE, ops.DELETE, ops.REVOKE)
OP_NAMES = {ops.SET: "set", ops.ASSIGN: "assign", ops.GROW: "grow", ops.COUNT: "inc",
            ops.ADD: "add", ops.REMOVE: "remove", ops.DELETE: "delete", ops.GRANT: "grant",
            ops.REVOKE: "revoke"}


class Rejected(Exception):
    """A well-formed change this document refuses: another document's, a
    non-writer's, an access change not by the owner, or a wrong Lamport clock."""


def doc_id(owner: bytes, name: str) -> bytes:
    """The 32-byte id of the document ``name`` owned by key ``owner``."""
    check_name(name)
    return blake3.blake3(b"meshd-crdt-doc/1" + owner + name.encode()).digest()


def check_name(name: str) -> None:
    if not isinstance(name, str) or not 0 < len(name.encode()) <= MAX_NAME:
        raise ValueError(f"a document name is 1 to {MAX_NAME} bytes of text")


class Acl:
    """The access rule: the owner, plus add-wins sets of writer and reader keys."""

    def __init__(self, owner: bytes):
        self.owner = owner
        self.roles = {"writer": ORSet(), "reader": ORSet()}

    def apply(self, change: Change) -> None:
        for index, op in enumerate(change.ops):
            if op[0] == ops.GRANT:
                self.roles[op[1]].put(dot_of(change, index), op[2])
            elif op[0] == ops.REVOKE:
                self.roles[op[1]].discard(tuple(d) for d in op[3])

    def members(self, role: str) -> set[bytes]:
        return self.roles[role].value()

    def may_write(self, key: bytes) -> bool:
        return key == self.owner or key in self.members("writer")

    def may_read(self, key: bytes) -> bool:
        readers = self.members("reader")
        return self.may_write(key) or key in readers or ANYONE in readers


@dataclass(slots=True)
class _Meta:
    lamport: int
    author: bytes
    acl: frozenset  # ids of the access-changing changes in its causal past, itself included


class Document:
    """One replica of the document ``name`` owned by key ``owner``.

    Changes made here are at most ``max_change`` bytes and ``max_ops``
    operations (what replicas that decode with those limits accept).
    """

    def __init__(self, owner: bytes, name: str, *, max_pending: int = 10_000,
                 max_pending_bytes: int = 32 << 20, max_change: int = ops.MAX_CHANGE,
                 max_ops: int = ops.MAX_OPS):
        self.owner, self.name, self.id = owner, name, doc_id(owner, name)
        self.root = ORMap()
        self.acl = Acl(owner)
        self.items = ItemSet()  # sync keys of every applied change
        self.heads: set[bytes] = set()
        self.equivocators: set[bytes] = set()
        self._meta: dict[bytes, _Meta] = {}
        self._positions: dict[tuple[bytes, int], bytes] = {}
        self._acl_changes: dict[bytes, Change] = {}
        self._acl_cache: dict[frozenset, Acl] = {frozenset(): Acl(owner)}
        self._pending: dict[bytes, Change] = {}
        self._waiting: dict[bytes, set[bytes]] = {}
        self._pending_bytes = 0
        self.max_pending, self.max_pending_bytes = max_pending, max_pending_bytes
        self.max_change, self.max_ops = max_change, max_ops

    # --- reading -----------------------------------------------------------------

    def __contains__(self, change_id: bytes) -> bool:
        return change_id in self._meta

    def __len__(self) -> int:
        return len(self._meta)

    @property
    def pending(self) -> int:
        """How many early changes wait for their dependencies."""
        return len(self._pending)

    def missing(self) -> set[bytes]:
        """Ids that buffered changes wait for."""
        return set(self._waiting)

    def state(self, path: Iterable[str] = ()) -> object | None:
        """The visible state at ``path`` (an ORMap at the root), or None."""
        node: object = self.root
        for key in path:
            if not isinstance(node, ORMap):
                return None
            node = node.get(key)
        return node

    def raw(self, path: list[str], kind: str) -> object | None:
        """The ``kind`` state at ``path`` whether visible or not (a removed
        counter keeps its totals), or None if there never was one."""
        node = self.root
        for key in path[:-1]:
            node = node.children.get(key, {}).get(MAP)
            if node is None:
                return None
        return node.children.get(path[-1], {}).get(kind) if path else node

    def get(self, path: Iterable[str] = ()) -> object:
        """The plain value at ``path``: dict, set, list (multi-value), int, or a register's value."""
        node = self.state(path)
        return None if node is None else node.value()

    # --- taking changes in ---------------------------------------------------------

    def receive(self, change: Change) -> list[Change]:
        """Apply ``change`` and any buffered changes it unblocks; return those applied.

        A change whose dependencies are missing is buffered (the oldest
        buffered changes are dropped beyond the limits) and [] is returned.
        Raises Rejected if ``change`` itself is refused; a refused buffered
        change is dropped silently.
        """
        if change.id in self._meta or change.id in self._pending:
            return []
        if change.doc != self.id:
            raise Rejected("change belongs to another document")
        missing = [d for d in change.deps if d not in self._meta]
        if missing:
            self._buffer(change, missing)
            return []
        self._admit(change)
        applied, ready = [change], [change.id]
        while ready:
            for waiter_id in self._waiting.pop(ready.pop(), ()):
                waiter = self._pending.get(waiter_id)
                if waiter is None or any(d not in self._meta for d in waiter.deps):
                    continue
                self._unbuffer(waiter_id)
                try:
                    self._admit(waiter)
                except Rejected:
                    continue
                applied.append(waiter)
                ready.append(waiter_id)
        return applied

    def _buffer(self, change: Change, missing: list[bytes]) -> None:
        self._pending[change.id] = change
        self._pending_bytes += len(change.wire)
        for dep in missing:
            self._waiting.setdefault(dep, set()).add(change.id)
        while len(self._pending) > self.max_pending or self._pending_bytes > self.max_pending_bytes:
            self._unbuffer(next(iter(self._pending)))

    def _unbuffer(self, change_id: bytes) -> None:
        change = self._pending.pop(change_id)
        self._pending_bytes -= len(change.wire)
        for dep in change.deps:
            waiters = self._waiting.get(dep)
            if waiters is not None:
                waiters.discard(change_id)
                if not waiters:
                    del self._waiting[dep]

    def _admit(self, change: Change) -> None:
        """Check ``change`` against its causal past, then apply it."""
        if change.doc != self.id:
            raise Rejected("change belongs to another document")
        top = max((self._meta[d].lamport for d in change.deps), default=0)
        if change.lamport != top + 1:
            raise Rejected(f"lamport {change.lamport} is not one above its dependencies' {top}")
        past = self._acl_past(change.deps)
        if not self._acl_at(past).may_write(change.author):
            raise Rejected("author may not write this document")
        if not _sees_only_its_past(change):
            raise Rejected("an operation removes a dot its change cannot have seen")
        touches_acl = any(op[0] in (ops.GRANT, ops.REVOKE) for op in change.ops)
        if touches_acl and change.author != self.owner:
            raise Rejected("only the owner may change who writes and reads")
        self._apply(change, past | {change.id} if touches_acl else past)

    def _acl_past(self, deps: Iterable[bytes]) -> frozenset:
        sets = {self._meta[d].acl for d in deps}
        if len(sets) <= 1:
            return sets.pop() if sets else frozenset()
        return frozenset().union(*sets)

    def _acl_at(self, past: frozenset) -> Acl:
        acl = self._acl_cache.get(past)
        if acl is None:
            acl = Acl(self.owner)
            for change_id in past:
                acl.apply(self._acl_changes[change_id])
            if len(self._acl_cache) > 256:
                self._acl_cache.clear()
            self._acl_cache[past] = acl
        return acl

    def _apply(self, change: Change, acl: frozenset) -> None:
        self._meta[change.id] = _Meta(change.lamport, change.author, acl)
        self.items.add(change.key)
        self.heads.difference_update(change.deps)
        self.heads.add(change.id)
        position = (change.author, change.lamport)
        if self._positions.setdefault(position, change.id) != change.id:
            self.equivocators.add(change.author)
        if acl and change.id in acl:
            self._acl_changes[change.id] = change
            self.acl.apply(change)
        for index, op in enumerate(change.ops):
            if op[0] not in (ops.GRANT, ops.REVOKE):
                self._apply_op((change.lamport, change.author, index), op)

    def _apply_op(self, dot: Dot, op: list) -> None:
        code, path = op[0], op[1]
        node = self.root
        if code == ops.DELETE:
            for key in path[:-1]:
                node = node.children.get(key, {}).get(MAP)
                if node is None:
                    return
            node.remove_key(path[-1], (tuple(d) for d in op[2]))
            return
        for key in path[:-1]:
            node = node.child(key, MAP, dot)
        leaf = node.child(path[-1], _OP_KINDS[code], dot)
        if code == ops.SET:
            leaf.assign(dot, op[2])
        elif code == ops.GROW:
            leaf.raise_to(dot[1], op[2])
        elif code == ops.COUNT:
            leaf.inc.raise_to(dot[1], op[2])
            leaf.dec.raise_to(dot[1], op[3])
        else:  # ASSIGN, ADD, REMOVE: replace what was seen, then put the new entry
            leaf.discard(tuple(d) for d in op[3])
            if code != ops.REMOVE:
                leaf.put(dot, op[2])

    # --- snapshots ---------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """The state and op-log index as bytes; :meth:`restore` gives an equal replica back."""
        metas = sorted([i, m.lamport, m.author, sorted(m.acl)] for i, m in self._meta.items())
        return msgpack.packb([self.root.encode(), metas, sorted(self.heads), sorted(self.equivocators)],
                             use_bin_type=True)

    def restore(self, snapshot: bytes, acl_changes: Iterable[Change]) -> None:
        """Load a :meth:`snapshot` into this empty document; ``acl_changes`` are
        the access-changing changes it covers (kept in the op log)."""
        root, metas, heads, equivocators = msgpack.unpackb(snapshot, raw=False)
        self.root = ORMap.decode(root)
        interned: dict[tuple, frozenset] = {}
        for change_id, lamport, author, acl in metas:
            acl = interned.setdefault(tuple(acl), frozenset(acl))
            self._meta[change_id] = _Meta(lamport, author, acl)
            self.items.add(lamport.to_bytes(8, "big") + change_id)
            self._positions.setdefault((author, lamport), change_id)
        self.heads, self.equivocators = set(heads), set(equivocators)
        for change in acl_changes:
            self._acl_changes[change.id] = change
            self.acl.apply(change)

    # --- making changes ---------------------------------------------------------------

    def transaction(self) -> "Transaction":
        """A builder of one change; see :meth:`prepare`."""
        return Transaction(self)

    def prepare(self, tx: "Transaction", author: bytes, sign: Callable[[bytes], bytes],
                time_ms: int) -> Change:
        """Sign ``tx`` as a change on top of the current heads, without applying it.

        The caller stores it, then applies it with :meth:`receive`, with no
        other change made in between.  Raises Rejected if ``author`` may not
        make it, ChangeError if it is too large.
        """
        if not tx.intents:
            raise ChangeError("an empty transaction")
        if not self.acl.may_write(author):
            raise Rejected("this key may not write this document")
        deps = sorted(self.heads, key=lambda h: self._meta[h].lamport)[-ops.MAX_DEPS:]
        lamport = 1 + max((self._meta[h].lamport for h in deps), default=0)
        built = tx.build(author, lamport)
        if any(op[0] in (ops.GRANT, ops.REVOKE) for op in built) and author != self.owner:
            raise Rejected("only the owner may change who writes and reads")
        return sign_change(self.id, author, lamport, deps, time_ms, built, sign,
                           max_change=self.max_change, max_ops=self.max_ops)


class Transaction:
    """Operations recorded against a document, built into one change at prepare time.

    Paths are lists (or tuples) of str keys; every call checks its arguments at
    once and raises ValueError (ChangeError) if they are bad.
    """

    def __init__(self, doc: Document):
        self.doc = doc
        self.intents: list[tuple] = []

    def set(self, path, value) -> None:
        """Set the last-writer-wins register at ``path``."""
        path = _path(path)
        check_value(value)
        self.intents.append((ops.SET, path, value))

    def assign(self, path, value) -> None:
        """Set the multi-value register at ``path``, replacing the values seen."""
        path = _path(path)
        check_value(value)
        self.intents.append((ops.ASSIGN, path, value))

    def inc(self, path, amount: int = 1, *, grow_only: bool = False) -> None:
        """Add ``amount`` (may be negative unless ``grow_only``) to the counter at ``path``."""
        path = _path(path)
        if type(amount) is not int or (grow_only and amount <= 0) or abs(amount) >= ops.MAX_INT:
            raise ChangeError("a counter increment is an int; a grow-only one is positive")
        self.intents.append((ops.GROW if grow_only else ops.COUNT, path, amount))

    def add(self, path, element) -> None:
        """Add ``element`` (int, str or bytes) to the set at ``path``."""
        path = _path(path)
        check_element(element)
        self.intents.append((ops.ADD, path, element))

    def remove(self, path, element) -> None:
        """Remove ``element`` from the set at ``path`` (adds not yet seen survive)."""
        path = _path(path)
        check_element(element)
        self.intents.append((ops.REMOVE, path, element))

    def delete(self, path) -> None:
        """Remove the map key at ``path`` and reset what is below it."""
        self.intents.append((ops.DELETE, _path(path), None))

    def grant(self, key: bytes, role: str = "writer") -> None:
        """Let ``key`` write (or read); owner only.  ``ANYONE`` as a reader makes the document public."""
        self.intents.append((ops.GRANT, _role(role), _key(key)))

    def revoke(self, key: bytes, role: str = "writer") -> None:
        """Take ``role`` away from ``key``; owner only."""
        self.intents.append((ops.REVOKE, _role(role), _key(key)))

    def build(self, author: bytes, lamport: int) -> list:
        """The wire operations, computed against the document plus this transaction's earlier ones."""
        doc = self.doc
        # Dots of this transaction's earlier operations: at a path, for an element
        # at a path, and at or below each path prefix.
        at: dict[tuple, list[Dot]] = {}
        of: dict[tuple, list[Dot]] = {}
        under: dict[tuple, list[Dot]] = {}
        totals: dict[tuple, list[int]] = {}
        out = []
        for index, (code, path, arg) in enumerate(self.intents):
            dot = (lamport, author, index)
            key = tuple(path) if code < ops.GRANT else ("\0acl", path)
            if code == ops.SET:
                out.append([code, path, arg])
            elif code in (ops.GROW, ops.COUNT):
                total = totals.get((code,) + key)
                if total is None:
                    total = totals[(code,) + key] = self._totals(code, path, author)
                total[0 if arg >= 0 else 1] += abs(arg)
                out.append([code, path, total[0]] if code == ops.GROW else [code, path, *total])
            elif code == ops.ASSIGN:
                state = doc.raw(path, MV)
                seen = list(state.entries) if state else []
                out.append([code, path, arg, _dots(seen + at.get(key, []))])
            elif code in (ops.ADD, ops.REMOVE):
                state = doc.raw(path, SET)
                seen = state.dots_of(arg) if state else []
                out.append([code, path, arg, _dots(seen + of.get((key, arg), []))])
            elif code == ops.DELETE:
                parent = doc.raw(path[:-1], MAP)
                seen = parent.subtree_dots(path[-1]) if parent else []
                out.append([code, path, _dots(seen + under.get(key, []))])
            elif code == ops.GRANT:
                out.append([code, path, arg])
            else:  # REVOKE
                seen = doc.acl.roles[path].dots_of(arg)
                out.append([code, path, arg, _dots(seen + of.get((key, arg), []))])
            at.setdefault(key, []).append(dot)
            if code in (ops.ADD, ops.GRANT):
                of.setdefault((key, arg), []).append(dot)
            if code < ops.GRANT:
                for depth in range(1, len(key) + 1):
                    under.setdefault(key[:depth], []).append(dot)
        return out

    def _totals(self, code: int, path: list, author: bytes) -> list[int]:
        if code == ops.GROW:
            state = self.doc.raw(path, GCOUNTER)
            return [state.counts.get(author, 0) if state else 0]
        state = self.doc.raw(path, PNCOUNTER)
        return [state.inc.counts.get(author, 0), state.dec.counts.get(author, 0)] if state else [0, 0]


def _sees_only_its_past(change: Change) -> bool:
    """Every dot an operation removes is older than its change, or an earlier
    operation of the same change: a writer cannot remove writes yet to come."""
    for index, op in enumerate(change.ops):
        if op[0] in _NAMES_DOTS:
            for lamport, author, position in op[-1]:
                if lamport > change.lamport or (lamport == change.lamport and (
                        author != change.author or position >= index)):
                    return False
    return True


def _dots(dots: Iterable[Dot]) -> list:
    return [list(d) for d in dots]


def _path(path) -> list:
    if not isinstance(path, (str, list, tuple)):
        raise ChangeError("a path is a str key or a list of them")
    path = [path] if isinstance(path, str) else list(path)
    check_path(path)
    return path


def _role(role: str) -> str:
    if role not in ops.ROLES:
        raise ChangeError(f"role must be one of {', '.join(ops.ROLES)}")
    return role


def _key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) != ops.KEY_SIZE:
        raise ChangeError("a key is 32 raw bytes (an Ed25519 public key)")
    return key
