"""The mixed work of a soak and the ledger of what was acknowledged.

Each workload is a loop, bounded by a deadline and a count, that picks a live
daemon of its cluster at random and drives it through its control socket
(:func:`meshd.connect`), as a user's script would.  An operation that fails
because the chaos killed or cut its daemon is counted by error type and the
loop goes on; an operation's result is written to the :class:`Ledger` only
once the daemon acknowledged it, so the checks at the end hold the mesh to
exactly what it promised.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import trio

import meshd
from ..localmesh import DaemonError
from .mesh import MIB, Cluster, Slot

DOC = "soak"
MODEL = "soak/model"
TENSOR_BYTES = MIB  # each tensor of a soak model: 256 x 1024 float32


class Refused(Exception):
    """The daemon answered, but not with an acknowledgement (a put stored nowhere)."""


def chaos_errors() -> tuple[type[BaseException], ...]:
    """What an operation may raise when its daemon was killed or cut off: counted, not a bug.

    Anything else (a TypeError, a KeyError in a reply) propagates and ends the soak.
    """
    return (meshd.RpcError, meshd.DaemonNotRunning, OSError, DaemonError, Refused, trio.TooSlowError,
            trio.BrokenResourceError, trio.ClosedResourceError)


@dataclass
class Tally:
    """Operations of one kind: acknowledged, and failed by error type."""

    ok: int = 0
    failed: Counter = field(default_factory=Counter)
    example: dict[str, str] = field(default_factory=dict)  # error type -> its first message


@dataclass
class Ledger:
    """What one cluster's work did, and everything the daemons acknowledged."""

    ops: dict[str, Tally] = field(default_factory=dict)
    doc_ref: str = ""
    acked: set[str] = field(default_factory=set)  # elements of the document's "acked" set
    dht_written: dict[bytes, set[bytes]] = field(default_factory=dict)  # every value a put tried
    dht_acked: dict[bytes, bytes] = field(default_factory=dict)  # the last acknowledged value per key
    dht_foreign: list[str] = field(default_factory=list)  # gets that returned a value nobody put
    models: list[tuple[str, str]] = field(default_factory=list)  # (NAME@VERSION, sha256 of the file)
    fetch_mismatches: list[str] = field(default_factory=list)

    def tally(self, kind: str) -> Tally:
        return self.ops.setdefault(kind, Tally())


@dataclass
class Pace:
    """How hard the work pushes: a pause between one worker's operations, and bounds."""

    op_timeout: float = 20.0
    pause: float = 0.2
    max_ops: int = 100_000  # per worker: a bound on every loop besides the deadline
    dht_keys: int = 16
    model_mib: int = 8
    max_versions: int = 6


async def attempt(ledger: Ledger, kind: str, slot: Slot, operation, timeout: float):
    """``await operation()`` on ``slot`` within ``timeout``; its result, or None if it failed
    as chaos makes things fail.  The slot counts as busy meanwhile."""
    slot.busy += 1
    try:
        with trio.fail_after(timeout):
            result = await operation()
    except chaos_errors() as exc:
        tally = ledger.tally(kind)
        tally.failed[type(exc).__name__] += 1
        tally.example.setdefault(type(exc).__name__, str(exc)[:160])
        return None
    finally:
        slot.busy -= 1
    ledger.tally(kind).ok += 1
    return result


def pick(rng: random.Random, slots: list[Slot]) -> Slot | None:
    """A random slot among ``slots`` that is up, or None."""
    live = [slot for slot in slots if slot.up]
    return rng.choice(live) if live else None


async def open_document(cluster: Cluster, ledger: Ledger) -> None:
    """The seed creates the document and lets every slot write; each slot opens it."""
    async with meshd.connect(cluster.seed.daemon.data_dir) as client:
        doc = await client.document(DOC, create=True)
        await doc.write([["grant", slot.daemon.peer_id, "writer"] for slot in cluster.victims])
    ledger.doc_ref = f"{cluster.seed.daemon.peer_id}/{DOC}"
    for slot in cluster.victims:
        async with meshd.connect(slot.daemon.data_dir) as client:
            await client.document(ledger.doc_ref)


async def write_document(cluster: Cluster, ledger: Ledger, rng: random.Random, worker: int, pace: Pace,
                         deadline: float) -> None:
    """Add unique elements to the document's ``acked`` set (and 1 to ``count`` in the same change)."""
    for n in range(pace.max_ops):
        if trio.current_time() >= deadline:
            return
        slot = pick(rng, cluster.slots)
        if slot is not None:
            element = f"{slot.name}/w{worker}/{n}"

            async def write(slot=slot, element=element):
                async with meshd.connect(slot.daemon.data_dir) as client:
                    doc = await client.document(ledger.doc_ref)
                    await doc.write([["add", ["acked"], element], ["inc", ["count"], 1]])
                return element

            if await attempt(ledger, "doc write", slot, write, pace.op_timeout) is not None:
                ledger.acked.add(element)
        await trio.sleep(pace.pause)


async def put_and_get(cluster: Cluster, ledger: Ledger, rng: random.Random, worker: int, pace: Pace,
                      deadline: float) -> None:
    """DHT puts of unique values under a few shared keys, each followed by a get on another node."""
    for n in range(pace.max_ops):
        if trio.current_time() >= deadline:
            return
        writer, reader = pick(rng, cluster.slots), pick(rng, cluster.slots)
        if writer is not None and reader is not None:
            key = f"/open/soak/{cluster.name}/k{rng.randrange(pace.dht_keys)}".encode()
            value = f"{writer.name}/d{worker}/{n}".encode()
            ledger.dht_written.setdefault(key, set()).add(value)

            async def put():
                async with meshd.connect(writer.daemon.data_dir) as client:
                    if await client.dht_put(key, value) < 1:
                        raise Refused("stored on no replica")
                return value

            async def get():
                async with meshd.connect(reader.daemon.data_dir) as client:
                    return await client.dht_get(key) or {}

            if await attempt(ledger, "dht put", writer, put, pace.op_timeout) is not None:
                ledger.dht_acked[key] = value
            record = await attempt(ledger, "dht get", reader, get, pace.op_timeout)
            if record and record["value"] not in ledger.dht_written[key]:
                ledger.dht_foreign.append(f"{key!r} -> {record['value']!r} on {reader.name}")
        await trio.sleep(pace.pause)


class ModelSource:
    """Versions of one small model: each changes one tensor of the last, so fetches move only that chunk."""

    def __init__(self, folder: Path, rng: random.Random, mib: int):
        import torch  # only the publisher needs it

        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.generator = torch.Generator().manual_seed(rng.randrange(2**32))
        self.tensors = {f"layer{i:02}.weight": self._tensor() for i in range(max(1, mib))}
        self.versions = 0

    def _tensor(self):
        import torch

        return torch.randn(TENSOR_BYTES // 4096, 1024, generator=self.generator)

    def next_file(self) -> tuple[Path, str]:
        """Write the next version's ``.safetensors`` file; its path and sha256."""
        from meshd.services.shards.format import encode_tensors, write_safetensors

        if self.versions:
            names = sorted(self.tensors)
            self.tensors[names[self.versions % len(names)]] = self._tensor()
        self.versions += 1
        path = self.folder / f"v{self.versions}.safetensors"
        layout, chunks = encode_tensors(self.tensors)
        write_safetensors(layout, dict(zip([c.id for c in layout.chunks], chunks)), path)
        return path, hashlib.sha256(path.read_bytes()).hexdigest()


async def publish_models(cluster: Cluster, ledger: Ledger, source: ModelSource, pace: Pace,
                         deadline: float, interval: float) -> None:
    """The seed publishes a new version of the model every ``interval`` s, ``pace.max_versions`` at most."""
    for _ in range(pace.max_versions):
        if trio.current_time() >= deadline:
            return
        path, digest = await trio.to_thread.run_sync(source.next_file)

        async def publish():
            async with meshd.connect(cluster.seed.daemon.data_dir) as client:
                return await client.publish_model(path, MODEL)

        published = await attempt(ledger, "publish", cluster.seed, publish, pace.op_timeout)
        if published is not None:
            ledger.models.append((f"{MODEL}@{published['version']}", digest))
        await trio.sleep(interval)


async def fetch_models(cluster: Cluster, ledger: Ledger, rng: random.Random, worker: int, pace: Pace,
                       deadline: float, folder: Path) -> None:
    """Fetch a random published version on a random non-seed daemon into a file, and check its sha256."""
    for n in range(pace.max_ops):
        if trio.current_time() >= deadline:
            return
        slot = pick(rng, cluster.victims)
        if slot is not None and ledger.models:
            ref, digest = rng.choice(ledger.models)
            out = Path(folder) / f"{slot.name}-f{worker}-{n}.safetensors"

            async def fetch(slot=slot, ref=ref, out=out):
                async with meshd.connect(slot.daemon.data_dir) as client:
                    async with client.fetch_model(ref, out) as items:
                        async for item in items:
                            if item.get("done"):
                                return item
                raise Refused("the fetch stream ended without done")

            if await attempt(ledger, "fetch", slot, fetch, pace.op_timeout * 3) is not None:
                if hashlib.sha256(out.read_bytes()).hexdigest() != digest:
                    ledger.fetch_mismatches.append(f"{ref} fetched on {slot.name}")
            out.unlink(missing_ok=True)
            out.with_name(out.name + ".part").unlink(missing_ok=True)
        await trio.sleep(pace.pause * 5)
