"""Model names in the DHT, so that ``NAME@VERSION`` resolves on any node.

A model name is a first-come ``/name/`` record (:mod:`dht.names`: who owns
it, whom the owner lets publish) whose payload lists the name's newest
``MAX_VERSIONS`` versions, each with its model id, size, time and publisher.
This node remembers the owner it first saw for each name (:class:`KnownOwners`,
an SQLite file) and refuses a name whose owner has changed since, as SSH does a
host whose key has changed.  The names it publishes under it keeps alive
(:meth:`ModelNames.refresh`): a name record lives ``NAME_TTL``.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dht.ids import PUBLIC_KEY_SIZE
from dht.names import Claim, name_key, name_value, parse_name_value, sign_claim
from dht.records import MAX_TTL, MAX_VALUE, Record, RecordError

from ...identity import Identity, PeerId
from ...rpc import PermissionDenied
from ...wire import FrameError, pack, unpack
from .errors import FetchError

log = logging.getLogger("meshd.shards")

NAME_TTL = MAX_TTL  # seconds a name record lives unless refreshed (48 h)

MAX_VERSIONS = 64  # a name record keeps its newest versions; older ones resolve by id or registry
_MAX_INT = 2**63


@dataclass(frozen=True)
class Version:
    """One published version: the model id, its bytes, when, and by whom (a public key)."""

    id: bytes
    bytes: int
    time: int
    publisher: bytes


def encode_versions(versions: dict[int, Version]) -> bytes:
    """The payload of a name record: the newest ``MAX_VERSIONS`` of ``versions``."""
    newest = sorted(versions)[-MAX_VERSIONS:]
    return pack([[n, versions[n].id, versions[n].bytes, versions[n].time, versions[n].publisher] for n in newest])


def decode_versions(payload: bytes) -> dict[int, Version]:
    """The versions a name record's payload lists; RecordError if it is malformed."""
    try:
        raw = unpack(payload, MAX_VALUE)
    except FrameError as exc:
        raise RecordError(f"a model name's versions: {exc}") from None
    if not isinstance(raw, list) or len(raw) > MAX_VERSIONS:
        raise RecordError(f"a model name lists at most {MAX_VERSIONS} versions")
    versions = {}
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 5 and _count(entry[0]) and _key(entry[1])
                and _count(entry[2]) and _count(entry[3]) and _key(entry[4])):
            raise RecordError("a model name's version must be [number, id, bytes, time, publisher]")
        versions[entry[0]] = Version(*entry[1:])
    return versions


def _count(value: object) -> bool:
    return type(value) is int and 0 <= value < _MAX_INT


def _key(value: object) -> bool:
    return isinstance(value, bytes) and len(value) == PUBLIC_KEY_SIZE  # a model id or a public key


class KnownOwners:
    """The owner this node first saw for each name, and whether it publishes
    under the name itself; durable across restarts."""

    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS owners"
                         " (name TEXT PRIMARY KEY, owner BLOB NOT NULL, ours INTEGER NOT NULL)")

    def get(self, name: str) -> bytes | None:
        row = self._db.execute("SELECT owner FROM owners WHERE name = ?", (name,)).fetchone()
        return row[0] if row else None

    def remember(self, name: str, owner: bytes, *, ours: bool = False) -> None:
        """Record ``owner`` for ``name`` unless one is known already (``ours``: we publish under it)."""
        self._db.execute("INSERT INTO owners VALUES (?, ?, ?) ON CONFLICT(name) DO UPDATE"
                         " SET ours = MAX(ours, excluded.ours) WHERE owner = excluded.owner",
                         (name, owner, int(ours)))

    def forget(self, name: str) -> bool:
        """Drop the owner known for ``name`` (the next one seen is trusted); whether one was."""
        return self._db.execute("DELETE FROM owners WHERE name = ?", (name,)).rowcount > 0

    def ours(self) -> list[str]:
        """The names this node has published under."""
        return [name for name, in self._db.execute("SELECT name FROM owners WHERE ours ORDER BY name")]

    def close(self) -> None:
        self._db.close()


class Records(Protocol):
    """Signed DHT records (the DHT service's node)."""

    async def get(self, key: bytes) -> Record | None: ...
    async def put(self, key: bytes, value: bytes, *, ttl: float | None = None) -> int: ...


@dataclass
class Named:
    """A name as the DHT has it: its owner's claim, its versions and when its record expires."""

    claim: Claim
    versions: dict[int, Version]
    expires: int

    def version(self, wanted: str) -> Version | None:
        """``wanted`` ("latest": the highest) or None."""
        if wanted == "latest":
            return self.versions[max(self.versions)] if self.versions else None
        return self.versions.get(int(wanted)) if wanted.isdigit() else None

    def as_dict(self) -> dict:
        return {"owner": str(PeerId(self.claim.owner)), "writers": [str(PeerId(w)) for w in self.claim.writers],
                "versions": {str(n): {"id": v.id.hex(), "bytes": v.bytes, "time": v.time,
                                      "publisher": str(PeerId(v.publisher))} for n, v in sorted(self.versions.items())},
                "expires": self.expires}


class ModelNames:
    """Resolving, publishing under and sharing model names in the DHT."""

    def __init__(self, records: Records, identity: Identity, owners: KnownOwners) -> None:
        self._records = records
        self._identity = identity
        self.owners = owners

    async def get(self, name: str) -> Named | None:
        """The name as the DHT has it, or None; FetchError if its owner is not
        the one this node saw before (say how to accept the change)."""
        record = await self._records.get(name_key(name))
        if record is None:
            return None
        claim, payload = parse_name_value(record.value)  # the DHT admitted it: the claim verified
        known = self.owners.get(name)
        if known is not None and known != claim.owner:
            raise FetchError(
                f"{name} is now claimed by {PeerId(claim.owner)}, not by {PeerId(known)} as this node saw"
                f" before; if its owner changed on purpose: meshctl shards name {name} --forget-owner")
        self.owners.remember(name, claim.owner)
        return Named(claim, decode_versions(payload), record.expires)

    async def check_publisher(self, name: str) -> Named | None:
        """The name (None if unclaimed) if this node may publish under it, else PermissionDenied."""
        try:
            named = await self.get(name)
        except FetchError as exc:  # its owner changed
            raise PermissionDenied(str(exc)) from None
        if named is not None and not named.claim.may_write(self._identity.peer_id.key):
            raise PermissionDenied(
                f"{name} belongs to {PeerId(named.claim.owner)}; ask its owner to run"
                f" `meshctl shards allow {name} {self._identity.peer_id}`, or publish under another name")
        return named

    async def add_version(self, name: str, number: int, version: Version) -> None:
        """List ``version`` as ``name@number``, claiming the name if nobody has."""
        named = await self.check_publisher(name)
        if named is None:
            named = Named(self._claim(name_key(name), seq=0, writers=()), {}, 0)
        named.versions[number] = version
        await self._put(name, named)

    async def allow(self, name: str, peer: PeerId, *, revoke: bool = False) -> Named:
        """Let ``peer`` publish under ``name`` (``revoke``: no longer); owner only."""
        named = await self.get(name)
        me = self._identity.peer_id.key
        if named is None or named.claim.owner != me:
            owner = "nobody" if named is None else str(PeerId(named.claim.owner))
            raise PermissionDenied(f"only the owner of {name} may change who publishes under it (owner: {owner})")
        writers = [w for w in named.claim.writers if w != peer.key] + ([] if revoke else [peer.key])
        named.claim = self._claim(named.claim.key, seq=named.claim.seq + 1, writers=tuple(writers))
        await self._put(name, named)
        return named

    async def refresh(self) -> int:
        """Publish again, with a fresh expiry, each name this node publishes
        under whose record has less than half its life left; how many."""
        refreshed = 0
        for name in self.owners.ours():
            try:
                named = await self.check_publisher(name)
            except PermissionDenied as exc:
                log.warning("not refreshing the name %s: %s", name, exc)
                continue
            if named is not None and named.expires - time.time() < NAME_TTL / 2:
                await self._put(name, named)
                refreshed += 1
        return refreshed

    def _claim(self, key: bytes, *, seq: int, writers: tuple[bytes, ...]) -> Claim:
        seq = max(seq, time.time_ns() // 1_000_000)
        return sign_claim(key, owner=self._identity.peer_id.key, sign=self._identity.sign, seq=seq,
                          writers=writers)

    async def _put(self, name: str, named: Named) -> None:
        value = name_value(named.claim, encode_versions(named.versions))
        await self._records.put(name_key(name), value, ttl=NAME_TTL)
        self.owners.remember(name, named.claim.owner, ours=True)
