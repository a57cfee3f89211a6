"""Replicated documents from a training script: the client side of ``crdt.*``.

::

    async with meshd.connect("~/.meshd") as client:
        doc = await client.document("run42", create=True)
        await doc.counter("progress/steps").inc(100)
        async with doc.transaction() as tx:          # one signed change
            tx.set("model/current", "gpt@7")
            tx.add("members", "worker-3")
        print(await doc.get())
        async for event in doc.changes():           # every change from now on
            ...

A path is a list of map keys, or one string with keys separated by ``/``.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, AsyncIterator, Sequence

from .base import ControlClient

if TYPE_CHECKING:  # annotations only: meshctl imports this without cryptography or trio
    from ..identity import PeerId
    from ..rpc import ResponseStream

KeyPath = str | Sequence[str]


def split_path(path: KeyPath) -> list[str]:
    """``"a/b"`` or ``["a", "b"]`` as a list of keys (``""`` or ``[]``: the root)."""
    if isinstance(path, str):
        return [key for key in path.split("/") if key]
    return list(path)


class Batch:
    """Operations gathered by :meth:`RemoteDocument.transaction`, sent as one change."""

    def __init__(self) -> None:
        self.ops: list[list] = []
        self.change: str | None = None  # hex id, once written

    def set(self, path: KeyPath, value: object) -> None:
        self.ops.append(["set", split_path(path), value])

    def assign(self, path: KeyPath, value: object) -> None:
        self.ops.append(["assign", split_path(path), value])

    def inc(self, path: KeyPath, amount: int = 1, *, grow_only: bool = False) -> None:
        self.ops.append(["grow" if grow_only else "inc", split_path(path), amount])

    def add(self, path: KeyPath, element: int | str | bytes) -> None:
        self.ops.append(["add", split_path(path), element])

    def remove(self, path: KeyPath, element: int | str | bytes) -> None:
        self.ops.append(["remove", split_path(path), element])

    def delete(self, path: KeyPath) -> None:
        self.ops.append(["delete", split_path(path)])

    def grant(self, peer: PeerId | str, role: str = "writer") -> None:
        self.ops.append(["grant", str(peer), role])

    def revoke(self, peer: PeerId | str, role: str = "writer") -> None:
        self.ops.append(["revoke", str(peer), role])


class RemoteDocument:
    """A document the local daemon keeps.  Every write returns once the daemon
    has the change on disk (acknowledged); peers get it right after."""

    def __init__(self, client: ControlClient, ref: str):
        self.client, self.ref = client, ref

    async def get(self, path: KeyPath = ()) -> object:
        """The value at ``path``: dict (map), list (set, sorted; or multi-value), int, or a value."""
        return (await self.client.request("crdt.get", {"doc": self.ref, "path": split_path(path)}))["value"]

    async def info(self) -> dict:
        """Changes, heads, pending, peers, writers, readers, public, writable, equivocators."""
        return await self.client.request("crdt.info", {"doc": self.ref})

    async def write(self, ops: list[list]) -> str:
        """Apply ``ops`` (see :mod:`meshd.services.crdt.control`) as one change; returns its id (hex)."""
        return (await self.client.request("crdt.write", {"doc": self.ref, "ops": ops}))["change"]

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Batch]:
        """Gather operations; leaving the block without an error writes them as one change."""
        batch = Batch()
        yield batch
        if batch.ops:
            batch.change = await self.write(batch.ops)

    async def _one(self, method: str, *args) -> str:
        batch = Batch()
        getattr(batch, method)(*args)
        return await self.write(batch.ops)

    async def set(self, path: KeyPath, value: object) -> str:
        return await self._one("set", path, value)

    async def inc(self, path: KeyPath, amount: int = 1) -> str:
        return await self._one("inc", path, amount)

    async def add(self, path: KeyPath, element: int | str | bytes) -> str:
        return await self._one("add", path, element)

    async def remove(self, path: KeyPath, element: int | str | bytes) -> str:
        return await self._one("remove", path, element)

    async def delete(self, path: KeyPath) -> str:
        return await self._one("delete", path)

    async def grant(self, peer: PeerId | str, role: str = "writer") -> str:
        """Let ``peer`` write (or read, or ``"anyone"`` read); owner only."""
        return await self._one("grant", peer, role)

    async def revoke(self, peer: PeerId | str, role: str = "writer") -> str:
        return await self._one("revoke", peer, role)

    async def sync(self, peer: PeerId | str | None = None) -> dict:
        """Reconcile with ``peer`` (default: every known replica) now."""
        arg = {"doc": self.ref} if peer is None else {"doc": self.ref, "peer": str(peer)}
        return await self.client.request("crdt.sync", arg)

    @asynccontextmanager
    async def changes(self) -> AsyncIterator[ResponseStream]:
        """``async with doc.changes() as events: async for event in events``: each
        change applied from the moment the block is entered,
        ``{change, author, local, time_ms, ops: [...]}``, each op
        ``{op, path, value}`` (``{op, path, total}`` for counters: the author's
        running total; ``{op, path}`` for delete; ``{op, role, key}`` for grants).
        A reader more than 10,000 changes behind gets RESOURCE_EXHAUSTED."""
        async with self.client.stream("crdt.watch", {"doc": self.ref}) as events:
            await events.__anext__()  # {"watching": ...}: the daemon has subscribed us
            yield events

    # typed views of one path

    def counter(self, path: KeyPath) -> "Counter":
        return Counter(self, split_path(path))

    def register(self, path: KeyPath) -> "Register":
        return Register(self, split_path(path))

    def elements(self, path: KeyPath) -> "ElementSet":
        return ElementSet(self, split_path(path))


class _View:
    def __init__(self, doc: RemoteDocument, path: list[str]):
        self.doc, self.path = doc, path

    async def value(self) -> object:
        return await self.doc.get(self.path)


class Counter(_View):
    """A PN-counter: ``await c.value()``, ``await c.inc(n)`` (n may be negative)."""

    async def inc(self, amount: int = 1) -> str:
        return await self.doc.inc(self.path, amount)


class Register(_View):
    """A last-writer-wins register: ``await r.value()``, ``await r.set(v)``."""

    async def set(self, value: object) -> str:
        return await self.doc.set(self.path, value)


class ElementSet(_View):
    """An add-wins set: ``await s.value()`` (sorted list), ``add``, ``remove``."""

    async def add(self, element: int | str | bytes) -> str:
        return await self.doc.add(self.path, element)

    async def remove(self, element: int | str | bytes) -> str:
        return await self.doc.remove(self.path, element)


class CrdtMethods(ControlClient):
    """The client's ``crdt.*`` methods: the documents the daemon keeps."""

    async def document(self, ref: str, *, create: bool = False) -> RemoteDocument:
        """The daemon's replica of document ``ref`` (``NAME`` or ``PEERID/NAME``),
        created (ours) or joined (another node's) if the daemon does not keep it yet."""
        await self.request("crdt.open", {"doc": ref, "create": create})
        return RemoteDocument(self, ref)

    async def documents(self) -> list[dict]:
        """Every document the daemon keeps: ref, changes, peers, writers, ..."""
        return await self.request("crdt.ls")
