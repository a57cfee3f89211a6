"""A training group's membership document: who is in the group, since when, doing what, how fast.

With the ``crdt`` service on, a group keeps one replicated document,
``OWNER/learning.GROUP`` (:func:`document_name`), readable by anyone.  Each
member writes one entry of its own under ``members/PEERID``
(:func:`learn.membership.entry`): when it joined, its role (``joining``,
``contributor``, ``follower``), how many processes it speaks for (an
island's size, 1 for a plain member), the samples and inner steps per second
it measured since its last write, its round, when it wrote (``seen``) and how
often it writes (``every``: ``REFRESH_HEARTBEATS`` heartbeats), and, once it
leaves the group, when (``left``).  It writes at once when it opens the
document, then every ``every`` seconds, and sooner when its role changes, but
never twice within a heartbeat (:class:`learn.membership.Refresh`); never at
each step.  A member that stops writing reads as ``quiet`` after three of its
intervals; nobody deletes another's entry.

**Whose document.**  The crdt layer lets the owner write, and the keys the
owner granted; nothing else.  A member with no document yet takes the one
the live members name in their hellos (the lowest owner named), or, when
nobody names one a heartbeat after the group settled, starts its own.  A
member moves only to a lower owner that is live, so members that started
their own at the same moment end on the lowest one's.  The owner grants
``writer`` to every member it hears say hello in the group: groups are open
(anyone who knows the name may train in them), and so is their document.

**Whose entry.**  A writer may write any path, so readers take an entry only
if the change that set its current value was signed by the peer it is under
(:func:`meshd.registry.own_entries`); anything else under ``members`` is
counted as ``rejected``.  A member cannot forge another's entry; it can hide
one until that member's next write.  The document is advisory: rounds,
rosters, liveness and hashes never read it.

Without the crdt service there is no document, and status says so; a member
still measures its own throughput and role.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import trio

from crdt.document import MAX_NAME
from learn.membership import (
    MAX_CLIPPED, MAX_ISLAND, ROLES, STATES, Refresh, Throughput, check_entry, choose_owner, entry, state_of,
)

from ...identity import PeerId
from ...registry import open_registry, own_entries
from ...service import Documents, Host, Replica
from .group import Group, scoped_name

log = logging.getLogger("meshd.learning")

DOC_PREFIX = "learning."
REFRESH_HEARTBEATS = 10  # heartbeats between two writes of a member's entry
MEMBERS = "members"  # the document's map of entries, by peer id


def document_name(group: str) -> str:
    """The membership document's name for ``group`` (a digest of the name where it is too long)."""
    return scoped_name(DOC_PREFIX, group, "", MAX_NAME)


class Membership:
    """This member's entry in ``group``'s membership document, and what the document says of the others."""

    def __init__(self, host: Host, group: Group, documents: Documents | None, *, heartbeat: float):
        self._host = host
        self._docs = documents
        self.group = group
        self.me = host.peer_id.key
        self.heartbeat = heartbeat
        self.every = REFRESH_HEARTBEATS * heartbeat
        self.joined = time.time()
        self.role = "joining"
        self.island = 1
        self.meter = Throughput(trio.current_time())
        self.refresh = Refresh(self.every, heartbeat)
        self.owner: bytes | None = None  # the document's owner, once chosen
        self.replica: Replica | None = None
        self.note: str | None = ("no membership document: the crdt service is off on this node" if documents is None
                                 else "no membership document yet (opened a heartbeat after the group settles)")
        self.written = 0  # entries this member wrote
        self.updated = trio.Event()  # set (and renewed) whenever this member wrote its entry
        self._named: dict[bytes, bytes] = {}  # member -> the owner its hellos name
        self._left = False
        self.cancel_scope = trio.CancelScope()  # :meth:`run`'s, cancelled by :meth:`leave`

    @property
    def ref(self) -> str | None:
        """``OWNER/NAME`` of the document this member uses, or None."""
        return None if self.owner is None else f"{PeerId(self.owner)}/{document_name(self.group.name)}"

    # --- what the training loop and the hellos tell it ------------------------------------------

    def report(self, *, steps: int = 0, samples: int = 0, role: str | None = None, island: int | None = None) -> None:
        """Count inner ``steps`` and ``samples`` done, and say this member's ``role``
        (one of :data:`learn.membership.ROLES`) or ``island`` size if they changed."""
        self.meter.add(steps, samples)
        if role is not None:
            if role not in ROLES:
                raise ValueError(f"role is one of {', '.join(ROLES)}")
            self.role = role
        if island is not None:
            if type(island) is not int or not 1 <= island <= MAX_ISLAND:
                raise ValueError(f"an island is 1 to {MAX_ISLAND} processes")
            self.island = island

    def heard(self, peer: bytes, owner: object) -> None:
        """Note the document owner member ``peer`` names in its hello (``doc``), if any."""
        if isinstance(owner, bytes) and len(owner) == 32:
            self._named[peer] = owner
        else:
            self._named.pop(peer, None)

    # --- keeping the entry -------------------------------------------------------------------------

    async def run(self) -> None:
        """Choose, open and write the document every heartbeat until :meth:`leave`."""
        if self._docs is None:
            return
        with self.cancel_scope:
            await self.group.settled.wait()
            while True:
                await trio.sleep(self.heartbeat)  # the first time: hear the others' hellos, which name theirs
                await self.step()

    async def step(self) -> None:
        """One heartbeat's work: follow the group to its document, let new members write
        (the owner), and write this member's entry when it is due.  Nothing without documents."""
        if self._docs is None:
            return
        group = self.group
        live = set(group.live())
        self._named = {p: o for p, o in self._named.items() if p in group.view.members}
        owner = choose_owner(self.owner, [o for p, o in self._named.items() if p in live], live) or self.me
        if owner != self.owner:
            if self.owner is not None:
                log.info("%s: membership document moves to %s's", group.tag, PeerId(owner).short())
            self.owner, self.replica = owner, None
            group.announce["doc"] = owner
            self.refresh.reset()
        if self.replica is None:
            ref = self.ref
            try:
                self.replica = await open_registry(self._docs, ref)
            except Exception as exc:  # noqa: BLE001  (the crdt service's DocError and RPC failures: advisory)
                self.note = f"cannot open the membership document {ref}: {exc}"
                log.info("%s: %s", group.tag, self.note)
                return
        if owner == self.me:
            doc = self.replica.doc
            new = sorted(k for k in live if not doc.acl.may_write(k))
            if new:
                self._write(lambda tx: [tx.grant(k, "writer") for k in new], "grant")
        self._write_entry()

    def leave(self) -> None:
        """Write this member's last entry, which says it left (if it can write), and stop."""
        self.cancel_scope.cancel()
        if not self._left and self.replica is not None:
            self._left = True
            self._write_entry(left=time.time())

    def _write_entry(self, *, left: float | None = None) -> None:
        now = trio.current_time()
        said = (self.role, self.island, frozenset(self.group.suspects))
        if left is None and not self.refresh.due(now, said):
            return
        if not self.replica.doc.acl.may_write(self.me):
            self.note = (f"entry not written yet: {PeerId(self.owner).short()}, the document's owner, "
                         "has not let this member write")
            return
        samples_s, steps_s = self.meter.measure(now)
        value = entry(joined=self.joined, role=self.role, island=self.island, samples_s=samples_s,
                      steps_s=steps_s, round=self.group.round, seen=time.time(), every=self.every, left=left,
                      clipped=self._clipped())
        if self._write(lambda tx: tx.set([MEMBERS, str(self._host.peer_id)], value), "entry"):
            self.refresh.written(now, said)
            self.note = None
            self.written += 1
            self.updated.set()
            self.updated = trio.Event()

    def _clipped(self) -> dict[str, list[int]]:
        """What this member's rule clipped, for its entry: the :data:`MAX_CLIPPED` members
        it clipped most, each as [rounds clipped, rounds it was used in]."""
        group = self.group
        most = sorted((k for k, n in group.clipped.items() if n), key=lambda k: (-group.clipped[k], k))[:MAX_CLIPPED]
        return {str(PeerId(k)): [group.clipped[k], max(group.used[k], group.clipped[k])] for k in most}

    def _write(self, fill, what: str) -> bool:
        try:
            self._docs.write(self.replica, fill)
        except Exception as exc:  # noqa: BLE001  (the crdt service's DocError: a full disk, access taken away)
            self.note = f"{what} not written to {self.ref}: {exc}"
            log.info("%s: %s", self.group.tag, self.note)
            return False
        return True

    # --- reading ----------------------------------------------------------------------------------

    def entries(self) -> tuple[dict[str, dict], int]:
        """The entries the document holds (peer id text -> the entry's fields and its
        ``state``: live, quiet or left), and how many it holds that were rejected
        (not written by their own peer, or malformed)."""
        if self.replica is None:
            return {}, 0
        own, others = own_entries(self.replica.doc, [MEMBERS])
        now, rows, rejected = time.time(), {}, len(others)
        for peer, value in own.items():
            checked = check_entry(value)
            if checked is None:
                rejected += 1
                continue
            rows[peer] = {**checked, "state": state_of(checked, now)}
        return rows, rejected

    def summary(self, rows: dict[str, dict] | None = None, rejected: int = 0) -> dict:
        """What status says of the document: its ref and owner, whether this member
        may write it, its entries by state, the rejected ones, and a note (why there is
        no document, or why this member's entry is not written), or None."""
        if rows is None:
            rows, rejected = self.entries()
        counts = Counter(row["state"] for row in rows.values())
        writer = self.replica is not None and self.replica.doc.acl.may_write(self.me)
        return {"document": self.ref, "owner": str(PeerId(self.owner)) if self.owner else None,
                "writer": writer, "entries": {state: counts[state] for state in STATES},
                "rejected": rejected, "note": self.note}
