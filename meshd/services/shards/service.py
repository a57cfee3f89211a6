"""Publishing and fetching models between nodes.

Publish: a state_dict (or ``.safetensors`` file, whose header the manifest
keeps) becomes chunks in the node's :class:`ChunkStore`, streamed: cut, hashed
and stored a few chunks at a time (:meth:`ChunkStore.put_stream`), so the model
is never held twice; pinned under a signed manifest kept in
``DATA_DIR/manifests``; the node announces itself in the DHT as a provider of
``b"/shard/" + model id`` and records ``name -> version -> {id, publisher,
time}`` in the registry document (``shards.registry``, by default this node's
``models`` document).

Fetch: find the providers, take the manifest from any (it must hash to the
id asked for and carry a valid signature), then pull the chunks this node
lacks from all providers at once.  Each provider works through a shared queue
in batches sized by its measured throughput; a chunk that does not hash to
its id gets its sender dropped and goes back to the queue, as do the chunks of
a provider that fails.  Chunks travel over the bulk lane where there is a
direct path, else QUIC RPC (``shards.chunks``, a server stream).  A verified
chunk goes where the caller wants it: into the store, by a writer thread that
makes it durable with the rest of its group (up to 128 MiB, one round of
fsyncs) before it counts as had, so a fetch that is killed resumes with what
is missing (:meth:`Shards.pull`; afterwards the node provides the model too);
into the tensors of the result, opened by the lane straight into their place
(:meth:`Shards.fetch`, with ``store=False`` writing nothing at all); into a
``.safetensors`` file (``pull(out=)``, ``meshctl shards fetch -o``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Mapping, Sequence

import trio

from crdt.document import ANYONE
from crdt.reconcile import ReconcileError
from dht.network import DhtError

from ...groups import leaves
from ...identity import PeerId
from ...lane import Lane, LaneConfig, LaneError, LaneServer, open_lane
from ...rpc import InvalidArgument, NotFound, RpcError
from ...service import Documents, Host, Providers
from .config import ShardsSection
from .control import control_methods
from .errors import FetchError
from .names import KnownOwners, ModelNames, Named, Records, Version
from .format import (ChunkError, Layout, Manifest, ManifestError, SafetensorsFile, TensorBuffers, decode_manifest,
                     open_encoder, sign_manifest)
from .store import ONCE, ChunkStore, ChunkWriter, chunk_id as hash_chunk

LANE_METHOD = "shards.lane"  # issues this service's lane tokens

log = logging.getLogger("meshd.shards")

PROVIDER_PREFIX = b"/shard/"
MAX_IDS = 64  # chunk ids per shards.chunks request
_FIRST_BATCH = 2  # chunks a provider is first given; then about _BATCH_SECONDS' worth
_BATCH_SECONDS = 0.25  # of chunks at a provider's measured rate, per batch (at most MAX_IDS)
_CALL_TIMEOUT = 120.0
NAME_REFRESH = 3600.0  # seconds between checks that this node's names will not lapse
_PUBLISHING = "(publishing) "  # the name of a publish's own pin, until its manifest is kept


@dataclass
class Progress:
    """How a fetch is going: ``have_bytes`` of ``total_bytes`` are had (stored durably; in a
    fetch that stores nothing, landed in the result), ``fetched_bytes`` were received (a
    chunk received twice in the end game counts twice, one that failed its check not at
    all), and per provider: bytes, last batch rate, path, state."""

    model: str
    total_bytes: int
    have_bytes: int = 0
    fetched_bytes: int = 0
    providers: dict[str, dict] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"model": self.model, "total_bytes": self.total_bytes, "have_bytes": self.have_bytes,
                "fetched_bytes": self.fetched_bytes, "providers": self.providers}


class Shards:
    """The models a node keeps, publishes and fetches (service ``shards``, config ``[shards]``)."""

    name = "shards"

    def __init__(self, host: Host, config: ShardsSection, *, providers: Providers, records: Records,
                 documents: Documents, lane: LaneConfig = LaneConfig()) -> None:
        self._node = host
        self._config = config
        self._dht = providers
        self._docs = documents
        self.store = ChunkStore(host.data_dir / "chunks", max_bytes=config.max_bytes)
        self.names = ModelNames(records, host.identity, KnownOwners(host.data_dir / "names.sqlite"))
        self._manifest_dir = host.data_dir / "manifests"
        self._manifest_dir.mkdir(mode=0o700, exist_ok=True)
        for model, pin_name, *_ in self.store.pins():  # a publish cut short by a crash
            if pin_name.startswith(_PUBLISHING):
                self.store.unpin(model)
        self.fetches: dict[bytes, Progress] = {}
        # read_ahead: reading (and re-hashing) the next chunk overlaps sealing and sending this one
        self._lane = LaneServer(host, self._read, read_ahead=1, max_chunk=config.lane_max_chunk,
                                max_ids=config.lane_max_ids, limits=lane) if config.lane else None

    @property
    def host(self) -> Host:
        """The node this service runs on (what a fetch uses to reach providers)."""
        return self._node

    @property
    def lane_enabled(self) -> bool:
        return self._lane is not None

    async def open_lane(self, peer: PeerId) -> Lane | None:
        """A bulk lane to ``peer``, with this node's lane limits; None: use QUIC."""
        config = self._config
        return await open_lane(self._node, peer, method=LANE_METHOD, max_chunk=config.lane_max_chunk,
                               max_ids=config.lane_max_ids)

    def rpc_methods(self) -> dict:
        methods = {"shards.manifest": self._serve_manifest, "shards.chunks": self._serve_chunks}
        if self._lane is not None:
            methods[LANE_METHOD] = self._lane.issue
        return methods

    def control_methods(self) -> dict:
        return control_methods(self)

    def status(self) -> dict:
        """Models kept, fetches going, and the bulk lane's TCP port ("off" by config, None until it listens)."""
        return {"models": len(self.manifests()), "fetching": len(self.fetches),
                "lane": self._lane.port if self._lane is not None else "off"}

    def figures(self) -> dict:
        """For the metrics service: fetches not yet whole, the bytes they have and
        need, and the bytes every fetch since start received."""
        going = [p for p in self.fetches.values() if p.have_bytes < p.total_bytes]
        return {"fetches": len(going), "fetch_have_bytes": sum(p.have_bytes for p in going),
                "fetch_total_bytes": sum(p.total_bytes for p in going),
                "fetched_bytes_total": sum(p.fetched_bytes for p in self.fetches.values())}

    def close(self) -> None:
        self.store.close()
        self.names.owners.close()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve the bulk lane (if enabled) and announce every whole model kept here
        once (the DHT re-announces them from then on); runs until cancelled."""
        async with trio.open_nursery() as nursery:
            if self._lane is not None:
                await nursery.start(self._lane.serve)
            task_status.started()
            for manifest in self.manifests():
                if not self.store.missing([c.id for c in manifest.chunks]):  # not a fetch cut short
                    await self._announce(manifest)
            while True:
                try:
                    await self.names.refresh()
                except DhtError as exc:
                    log.warning("could not refresh this node's model names: %s", exc)
                await trio.sleep(NAME_REFRESH)

    async def _read(self, chunk_id: bytes) -> bytes | None:
        """A chunk for a peer: re-hashed only the first time this store reads it (see
        ``ChunkStore.get``): every fetcher verifies every chunk anyway, and drops a
        provider that sends a bad one."""
        return await trio.to_thread.run_sync(functools.partial(self.store.get, chunk_id, verify=ONCE))

    # --- manifests on disk ----------------------------------------------------------

    def manifest(self, model_id: bytes) -> Manifest | None:
        """The manifest of a model this node keeps, or None."""
        try:
            data = (self._manifest_dir / model_id.hex()).read_bytes()
        except (FileNotFoundError, ValueError):
            return None
        return decode_manifest(data, verify=False)

    def manifests(self) -> list[Manifest]:
        return [m for m in (self.manifest(bytes.fromhex(p.name)) for p in self._manifest_dir.iterdir()
                            if len(p.name) == 64) if m is not None]

    def _keep(self, manifest: Manifest) -> None:
        """Pin the model's chunks and write its manifest (atomically, durably)."""
        self.store.pin(manifest.id, [c.id for c in manifest.chunks], f"{manifest.name}@{manifest.version}",
                       sizes=[c.length for c in manifest.chunks])
        path = self._manifest_dir / manifest.id.hex()
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(manifest.encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    async def unpin(self, model_id: bytes) -> bool:
        """Stop keeping a model: its chunks become collectable (unless another
        model shares them) and this node stops announcing it."""
        (self._manifest_dir / model_id.hex()).unlink(missing_ok=True)
        self._dht.unprovide(PROVIDER_PREFIX + model_id)
        return await trio.to_thread.run_sync(self.store.unpin, model_id)

    # --- publish ---------------------------------------------------------------------

    async def publish(self, source: Mapping | str | os.PathLike, *, name: str,
                      version: int | None = None) -> Manifest:
        """Store, sign, announce and register ``source`` as ``name@version``.

        ``version`` defaults to one above the highest the registry and the
        name in the DHT know.  PermissionDenied, before anything is stored, if
        another node owns the name and has not allowed this one.
        """
        named = await self._named(name, publishing=True)
        if version is None:
            known = [*await self.versions(name), *(named.versions if named else ())]
            version = 1 + max(known, default=0)
        manifest = await self._store_signed(source, name, version)
        await self._announce(manifest)
        await self._register(manifest)
        try:
            await self.names.add_version(name, version, Version(manifest.id, manifest.total_size,
                                                                manifest.created, manifest.publisher))
        except DhtError as exc:
            log.warning("could not name %s@%s in the DHT: %s", name, version, exc)
        return manifest

    def _store(self, source: Mapping | str | os.PathLike, pin: bytes, pin_name: str) -> Layout:
        """Cut, hash and store ``source`` as a stream, its chunks pinned under ``pin``:
        the model is never held whole (see :meth:`ChunkStore.put_stream`).  In a
        worker thread: a publish holds the store for a group's fsyncs at a time,
        which the event loop must not wait for."""
        self.store.pin(pin, [], pin_name)
        with open_encoder(source) as encoder:
            ids = self.store.put_stream(encoder.chunks(), pin=pin)
        return encoder.layout(ids)

    async def _announce(self, manifest: Manifest) -> None:
        try:
            await self._dht.provide(PROVIDER_PREFIX + manifest.id)
        except DhtError as exc:
            log.warning("could not announce %s: %s", manifest.id.hex()[:16], exc)

    # --- the registry ----------------------------------------------------------------

    async def _registry(self):
        """The registry document, created (readable by anyone) if it is ours and new."""
        ref = self._config.registry or "models"
        docs = self._docs
        ours = docs.is_own(ref)
        replica = await docs.open(ref, create=ours)
        if ours and len(replica.doc) == 0:
            docs.write(replica, lambda tx: tx.grant(ANYONE, "reader"))
        return replica

    async def _register(self, manifest: Manifest) -> None:
        replica = await self._registry()
        entry = {"id": manifest.id.hex(), "publisher": str(PeerId(manifest.publisher)),
                 "time": manifest.created, "bytes": manifest.total_size}
        self._docs.write(replica, lambda tx: tx.set([manifest.name, str(manifest.version)], entry))

    async def versions(self, name: str) -> list[int]:
        """The versions of ``name`` the registry lists."""
        entries = (await self._registry()).doc.get([name]) or {}
        return sorted(int(v) for v in entries if v.isdigit())

    async def resolve(self, ref: str) -> bytes:
        """The model id of ``NAME@VERSION``, ``NAME@latest``, ``NAME`` or a 64-hex id."""
        if len(ref) == 64:
            try:
                return bytes.fromhex(ref)
            except ValueError:
                pass
        name, _, version = ref.rpartition("@") if "@" in ref else (ref, "", "latest")
        replica = await self._registry()
        entry = _registry_entry(replica.doc.get([name]), version)
        if entry is None:  # perhaps just published elsewhere: catch up once and look again
            for peer in list(replica.peers):
                with contextlib.suppress(RpcError, ReconcileError):
                    await self._docs.sync(replica, peer)
            entry = _registry_entry(replica.doc.get([name]), version)
        if entry is not None:
            return bytes.fromhex(entry["id"])
        named = await self._named(name)
        found = named.version(version) if named else None
        if found is None:
            where = "nor does the name's record in the DHT" if named else "and no node has claimed the name"
            raise FetchError(f"the registry {replica.ref} has no {name}@{version}, {where}")
        return found.id

    async def _named(self, name: str, *, publishing: bool = False) -> Named | None:
        """The name's DHT record (None if unclaimed or the DHT cannot say); with
        ``publishing``, PermissionDenied unless this node may publish under it."""
        try:
            return await (self.names.check_publisher(name) if publishing else self.names.get(name))
        except DhtError as exc:
            log.warning("could not look up the name %s in the DHT: %s", name, exc)
            return None

    # --- fetch -------------------------------------------------------------------------

    async def pull(self, ref: str, *, on_progress: Callable[[Progress], None] | None = None,
                   out: str | os.PathLike | None = None) -> Manifest:
        """Make the model ``ref`` whole on this node (see :meth:`resolve`); returns its manifest.

        Every chunk is verified and stored; a chunk counts as had (``have_bytes``, what
        ``on_progress`` reports) once it is durable, so a pull that is killed resumes with
        what is missing.  ``out``: also write the model there as a ``.safetensors`` file,
        as the chunks arrive (see :class:`SafetensorsFile`; chunks this node had are read
        from its store), named ``out`` once whole (``out.part`` until then).
        """
        manifest, _ = await self._get(ref, store=True, tensors=False, out=out, on_progress=on_progress)
        return manifest

    async def fetch(self, ref: str, *, store: bool = True, into: Mapping | None = None,
                    on_progress: Callable[[Progress], None] | None = None) -> dict:
        """The tensors of model ``ref``, ready for ``load_state_dict``, every chunk verified.

        The tensors are filled in place as chunks arrive (chunks this node has are read from
        its store): memory holds the result plus a few chunks per provider.  With ``store``
        (the default) the chunks are also stored, durably, and the model kept and provided,
        as :meth:`pull` does.  With ``store=False`` nothing is written: no chunk, no
        manifest, no pin (a training member that joins needs tensors, not a copy on disk);
        such a fetch cannot resume, and the node does not become a provider.

        ``into``: fill these tensors instead of new ones, and return that mapping (e.g.
        ``model.state_dict()``: the model is loaded in place, with no second copy of it in
        memory).  They must be exactly the model's, each contiguous, on the CPU, of its
        dtype and shape, else ValueError before anything is fetched; if the fetch fails,
        what they hold is undefined.
        """
        _, tensors = await self._get(ref, store=store, tensors=True if into is None else into, out=None,
                                     on_progress=on_progress)
        return tensors.tensors if into is None else into

    async def _get(self, ref: str, *, store: bool, tensors: bool | Mapping, out: str | os.PathLike | None,
                   on_progress: Callable[[Progress], None] | None) -> tuple[Manifest, TensorBuffers | None]:
        """Pull ``ref``'s chunks into the store (``store``: those it lacks), a model's
        tensors (``tensors``: new ones, or these) and/or a file (``out``); returns the
        manifest and the tensors."""
        model_id = await self.resolve(ref)
        manifest, providers = self.manifest(model_id), None
        kept = manifest is not None
        if not kept:
            providers = await self._providers(model_id)
            manifest = await self._fetch_manifest(model_id, providers)
        buffers = None
        if tensors is not False:  # (checks what it is given to fill, before anything is kept)
            buffers = await trio.to_thread.run_sync(TensorBuffers, manifest, None if tensors is True else tensors)
        if store and not kept:  # pinned from the start: a resumed fetch keeps what it got
            await trio.to_thread.run_sync(self._keep, manifest)
        sizes = {c.id: c.length for c in manifest.chunks}
        file = await trio.to_thread.run_sync(SafetensorsFile, manifest, out) if out is not None else None
        sinks = [sink for sink in (buffers, file) if sink is not None]
        try:
            missing = await trio.to_thread.run_sync(self.store.missing, list(sizes))
            if sinks:  # what we have is read from the store, verified
                missing += await trio.to_thread.run_sync(self._read_into, sinks, set(sizes) - set(missing))
            progress = self.fetches[model_id] = Progress(
                model_id.hex(), manifest.total_size, manifest.total_size - sum(sizes[c] for c in missing))
            if missing:
                if providers is None:
                    providers = await self._providers(model_id)
                await _Download(self, manifest, deque(missing), providers, progress, on_progress,
                                store=store, buffers=buffers, file=file).run()
                if store:
                    await self._announce(manifest)  # whole now: a provider too
            if file is not None:
                await trio.to_thread.run_sync(file.commit)
        except BaseException:
            if file is not None:
                file.abort()
            raise
        if on_progress:
            on_progress(progress)
        return manifest, buffers

    def _read_into(self, sinks: list, chunk_ids: set[bytes]) -> list[bytes]:
        """Fill the sinks (tensors, a file) with these chunks from the store (each re-hashed);
        returns those it no longer has (a damaged file is removed by get: fetch it instead)."""
        lost = []
        for chunk_id in chunk_ids:
            data = self.store.get(chunk_id)
            if data is None:
                lost.append(chunk_id)
            else:
                for sink in sinks:
                    sink.fill(chunk_id, data)
        return lost

    async def _providers(self, model_id: bytes) -> list[PeerId]:
        try:
            found = await self._dht.find_providers(PROVIDER_PREFIX + model_id, 20)
        except DhtError as exc:
            raise FetchError(f"provider lookup failed: {exc}") from None
        return [p for p in (PeerId(c.public_key) for c in found) if p != self._node.peer_id]

    async def _fetch_manifest(self, model_id: bytes, providers: list[PeerId]) -> Manifest:
        for peer in providers:
            try:
                data = await self._node.rpc.call(peer, "shards.manifest", {"model": model_id}, timeout=30)
                manifest = decode_manifest(data if isinstance(data, bytes) else b"")
            except (RpcError, ManifestError) as exc:
                log.info("manifest of %s from %s: %s", model_id.hex()[:16], peer.short(), exc)
                continue
            if manifest.id == model_id:
                return manifest
            log.warning("%s sent a manifest that is not %s", peer.short(), model_id.hex()[:16])
        raise FetchError(f"no provider of {model_id.hex()} gave its manifest ({len(providers)} asked)")

    # --- tensor sets for other services (meshd.service.StateStore) -----------------------

    async def _store_signed(self, source, name: str, version: int) -> Manifest:
        """Chunk and store ``source`` (a state_dict or a file), sign its manifest as
        ``name@version`` and keep it (pinned); nothing is announced."""
        pin = os.urandom(32)  # holds the chunks while there is no manifest to pin them under
        try:
            layout = await trio.to_thread.run_sync(self._store, source, pin, f"{_PUBLISHING}{name}@{version}")
            manifest = sign_manifest(layout, name, version, sign=self._node.identity.sign,
                                     public_key=self._node.peer_id.key)
            await trio.to_thread.run_sync(self._keep, manifest)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.store.unpin, pin)
        return manifest

    async def publish_tensors(self, name: str, tensors: Mapping, *, version: int = 0) -> bytes:
        """Store, sign and keep ``tensors`` as ``name@version``; returns its model id.

        For a tensor set that lives briefly (a training member's state for a member
        that joins): no registry entry, no name record and no DHT announcement (the
        caller hands its fetchers the id and the providers).  The models this node
        published under ``name`` before are unpinned, and the store's unpinned chunks
        removed at once (a chunk the new set shares with them stays: it is pinned)."""
        manifest = await self._store_signed(tensors, name, version)
        with trio.CancelScope(shield=True):  # the new one is kept: the old ones go, even if we are cancelled
            me = self._node.peer_id.key
            old = [m.id for m in await trio.to_thread.run_sync(self.manifests)
                   if m.name == name and m.publisher == me and m.id != manifest.id]
            for model_id in old:
                await self.unpin(model_id)
            if old:
                await trio.to_thread.run_sync(self.store.gc)
        return manifest.id

    async def fetch_tensors(self, model_id: bytes, providers: Sequence[PeerId]) -> dict:
        """The tensors of model ``model_id`` from ``providers`` (the manifest from the first
        that has it, the chunks from all of them at once, every chunk verified), in memory:
        nothing is stored (as ``fetch(store=False)``), and the DHT is not asked."""
        providers = [p for p in dict.fromkeys(providers) if p != self._node.peer_id]
        manifest = await self._fetch_manifest(model_id, providers)
        buffers = await trio.to_thread.run_sync(TensorBuffers, manifest)
        progress = self.fetches[model_id] = Progress(model_id.hex(), manifest.total_size)
        await _Download(self, manifest, deque(dict.fromkeys(c.id for c in manifest.chunks)), providers, progress,
                        None, store=False, buffers=buffers, file=None).run()
        return buffers.tensors

    # --- serving -------------------------------------------------------------------------

    async def _serve_manifest(self, arg, ctx) -> bytes:
        model_id = arg.get("model") if isinstance(arg, dict) else None
        manifest = self.manifest(model_id) if isinstance(model_id, bytes) and len(model_id) == 32 else None
        if manifest is None:
            raise NotFound("no such model here")
        return manifest.encode()

    async def _serve_chunks(self, arg, ctx):
        ids = arg.get("ids") if isinstance(arg, dict) else None
        if not isinstance(ids, list) or not 0 < len(ids) <= MAX_IDS or not all(
                isinstance(i, bytes) and len(i) == 32 for i in ids):
            raise InvalidArgument(f"expected {{ids: 1 to {MAX_IDS} chunk ids}}")
        for chunk_id in ids:
            yield await self._read(chunk_id)  # None: not here


def _registry_entry(entries: object, version: str) -> dict | None:
    """The registry's entry for ``version`` ("latest": the highest) of one name, or None."""
    if not isinstance(entries, dict):
        return None
    if version == "latest":
        numbered = [v for v in entries if v.isdigit()]
        version = max(numbered, key=int) if numbered else ""
    entry = entries.get(version)
    return entry if isinstance(entry, dict) and isinstance(entry.get("id"), str) else None


class _Download:
    """One fetch's chunks, pulled from several providers through a shared queue.

    Each provider's worker takes a batch from the queue, sized to about a
    quarter second at its measured rate (and to a fair share of what is left).
    A chunk received is verified (blake3, in a worker thread, while the next
    arrive) and *lands*: it is copied into the tensors being assembled
    (``buffers``; a lane opens most chunks straight into their place, so there
    is nothing to copy) and the file being written (``file``), and/or handed to
    the store's :class:`ChunkWriter` (``store``), which makes it durable with the
    others of its group and only then counts it as had (``have_bytes``,
    progress).  Once the queue is empty, an idle worker asks its provider for
    chunks still in flight at another (the last half of the most left, each
    chunk at most twice), so a slow or stalled provider does not hold up the
    end; once every chunk has landed the workers are cancelled, and the fetch
    ends when the writer has made the last group durable.
    """

    def __init__(self, shards: Shards, manifest: Manifest, queue: deque, providers: list[PeerId],
                 progress: Progress, on_progress, *, store: bool, buffers: TensorBuffers | None,
                 file: SafetensorsFile | None) -> None:
        self.shards, self.manifest, self.queue = shards, manifest, queue
        self.providers, self.progress, self.on_progress = providers, progress, on_progress
        self.store, self.buffers, self.file = store, buffers, file
        self.sizes = {c.id: c.length for c in manifest.chunks}
        self.wanted = set(queue)  # not landed yet
        self.unsettled = set(queue)  # not durable (or, with no store, not landed) yet
        self.claims: dict[bytes, PeerId] = {}  # whose copy of a wanted chunk is in its place or being verified
        self.active: dict[PeerId, list[bytes]] = {}  # the batch each worker is pulling
        self.doubled: set[bytes] = set()  # also asked of a second provider
        self.workers = 0  # providers still taking batches
        self.writer: ChunkWriter | None = None
        self._durable: deque[list[bytes]] = deque()  # ids the writer made durable, for the trio thread
        self._event = trio.Event()  # set when a batch ends
        self._finished: trio.CancelScope | None = None

    async def run(self) -> None:
        if not self.providers:
            raise FetchError(f"nobody provides {self.manifest.id.hex()}")
        if self.store:
            token = trio.lowlevel.current_trio_token()

            def on_durable(ids: list[bytes]) -> None:  # in the writer's thread
                self._durable.append(ids)
                token.run_sync_soon(self._settle)
            self.writer = self.shards.store.writer(on_durable=on_durable)
        try:
            async with trio.open_nursery() as nursery:
                self._finished = nursery.cancel_scope
                for peer in self.providers:
                    nursery.start_soon(self._worker, peer)
        except BaseException:
            await self._close_writer(check=False)  # what landed becomes durable all the same
            raise
        await self._close_writer(check=True)
        for stats in self.progress.providers.values():
            if stats["state"] == "fetching":  # cancelled once the others had finished
                stats["state"] = "done" if stats["bytes"] else "not needed"
        if self.unsettled:
            raise FetchError(f"{len(self.unsettled)} chunks of {self.manifest.id.hex()} could not be fetched: "
                             f"{self.progress.providers}")

    async def _close_writer(self, *, check: bool) -> None:
        """Wait (shielded) for the writer to make what landed durable, and count it."""
        if self.writer is not None:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(lambda: self.writer.close(check=check))
            self._settle()

    def _changed(self) -> None:
        self._event.set()
        self._event = trio.Event()

    def _next_batch(self, size: int) -> list[bytes] | None:
        """Up to ``size`` chunks from the queue, and no more than a fair share of what it
        holds (so the last chunks are spread over the providers, not left in one large
        batch); once it is empty, the end game: the last half of what the provider with
        most left has not yet sent (what it would send last), each chunk at most twice."""
        size = min(size, max(1, -(-len(self.queue) // max(1, self.workers))))
        batch = []
        while self.queue and len(batch) < size:
            chunk_id = self.queue.popleft()
            if chunk_id in self.wanted:
                batch.append(chunk_id)
        if batch:
            return batch
        left = max(([c for c in other if c in self.wanted and c not in self.doubled and c not in self.claims]
                    for other in self.active.values()), key=len, default=[])
        if not left:
            return None
        spare = left[-max(1, min(size, len(left) // 2)):]
        self.doubled.update(spare)
        return spare

    async def _worker(self, peer: PeerId) -> None:
        """Take batches while chunks are wanted; a failure hands the batch back.

        Chunks come over the peer's bulk lane when it has a direct path and
        serves one, else (or once the lane fails) over QUIC."""
        stats = self.progress.providers.setdefault(str(peer), {"bytes": 0, "mb_s": 0.0, "state": "fetching"})
        lane = await self.shards.open_lane(peer) if self.shards.lane_enabled else None
        stats["path"] = "lane" if lane else "quic"
        rate, batch_size = 0.0, _FIRST_BATCH
        self.workers += 1
        try:
            while self.wanted:
                batch = self._next_batch(batch_size)
                if batch is None:  # all in flight elsewhere: wait for a batch to end
                    await self._event.wait()
                    continue
                started, got = time.monotonic(), 0
                self.active[peer] = batch
                try:
                    got = await (self._pull_lane(peer, lane, batch, stats) if lane
                                 else self._pull(peer, batch, stats))
                except LaneError as exc:
                    log.info("lane to %s failed (%s): QUIC from now on", peer.short(), exc)
                    lane, stats["path"] = None, "quic"
                    continue
                except (RpcError, ChunkError, trio.BrokenResourceError) as exc:
                    if self._finished.cancel_called and not isinstance(exc, ChunkError):
                        return  # torn down because the fetch is over, not the provider's fault
                    stats["state"] = f"dropped: {str(exc) or repr(exc)}"
                    log.info("fetch of %s: dropped %s: %s", self.manifest.id.hex()[:16], peer.short(), exc)
                    return
                finally:
                    del self.active[peer]
                    for chunk_id in [c for c, p in self.claims.items() if p == peer]:
                        del self.claims[chunk_id]  # received, not verified: the place is free again
                    back = [c for c in batch[got:] if c in self.wanted]
                    self.doubled.difference_update(back)
                    self.queue.extend(back)  # what it did not deliver goes to the others
                    self._changed()
                if got == 0:
                    stats["state"] = "has none of the rest"
                    return
                elapsed = max(time.monotonic() - started, 1e-3)
                moved = sum(self.sizes[c] for c in batch[:got])
                rate = moved / elapsed if rate == 0 else 0.5 * rate + 0.5 * moved / elapsed
                batch_size = max(1, min(MAX_IDS, int(rate * _BATCH_SECONDS / (self.manifest.chunk_size or 1))))
                stats["mb_s"] = round(rate / 1e6, 1)
            stats["state"] = "done"
        finally:
            self.workers -= 1
            if lane is not None:
                with trio.CancelScope(shield=True):
                    await lane.aclose()

    def _place(self, peer: PeerId, chunk_id: bytes, length: int) -> memoryview | None:
        """Where ``peer``'s lane may open this chunk: its place in the tensors, if it is
        wanted and no other provider's copy is being received there (the place is then
        claimed for ``peer``); else None (the lane makes a buffer of its own)."""
        if self.buffers is None or chunk_id not in self.wanted or chunk_id in self.claims:
            return None
        place = self.buffers.place(chunk_id, length)
        if place is not None:
            self.claims[chunk_id] = peer
        return place

    @asynccontextmanager
    async def _landing(self, peer: PeerId, stats: dict) -> AsyncIterator[tuple[trio.MemorySendChannel, list[int]]]:
        """A channel of ``(chunk id, bytes)`` that a task verifies and lands in order while
        the next chunks arrive; ``done[0]`` counts those handled (landed, or verified and
        dropped: a second copy of one landed from another provider).  ChunkError (raised
        here) if one does not verify, even a second copy: a provider sending bad bytes is
        dropped whether or not they were still needed."""
        send, receive = trio.open_memory_channel(2)
        done = [0]

        async def lander() -> None:
            with receive:  # closed at once on the way out: an async close's checkpoint could turn a
                async for chunk_id, data in receive:  # ChunkError into the Cancelled it brings about
                    placed = self.claims.get(chunk_id) == peer and chunk_id in self.wanted
                    land = placed or chunk_id in self.wanted and chunk_id not in self.claims
                    if land:
                        self.claims[chunk_id] = peer  # no other copy is landed meanwhile
                    await trio.to_thread.run_sync(self._land, chunk_id, data, placed, land)
                    if land:
                        self._landed(chunk_id)
                    stats["bytes"] += len(data)
                    self.progress.fetched_bytes += len(data)
                    done[0] += 1
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lander)
                with send:
                    yield send, done
        except BaseExceptionGroup as group:  # the caller handles one failure, by type: the cause
            failures = leaves(group)  # (a lander's failure, even a cancellation, breaks the channel sent on)
            cause = next((e for e in failures if not isinstance(e, (trio.BrokenResourceError, trio.Cancelled))),
                         None) or next((e for e in failures if isinstance(e, trio.Cancelled)), failures[0])
            raise cause from None

    def _land(self, chunk_id: bytes, data: bytes | memoryview, placed: bool, land: bool = True) -> None:
        """In a worker thread: verify the chunk, then (if ``land``) copy it into the tensors
        (unless it was received in its place: ``placed``) and the file, and/or hand it to
        the store's writer (which may wait for room in its window)."""
        if len(data) != self.sizes[chunk_id] or hash_chunk(data) != chunk_id:
            raise ChunkError(f"chunk {chunk_id.hex()[:16]}: the data does not hash to its id")
        if not land:
            return
        if self.buffers is not None and not placed:
            self.buffers.fill(chunk_id, data)
        if self.file is not None:
            self.file.fill(chunk_id, data)
        if self.writer is not None:
            self.writer.put(chunk_id, data)

    async def _pull_lane(self, peer: PeerId, lane: Lane, batch: list[bytes], stats: dict) -> int:
        """:meth:`_pull` over a bulk lane (which stops being usable after a chunk it lacks)."""
        async with self._landing(peer, stats) as (send, done):
            async for chunk_id, data in lane.fetch(batch, into=functools.partial(self._place, peer)):
                if data is None:
                    raise LaneError("the peer lacks a chunk")  # the lane is closed; QUIC takes over
                await send.send((chunk_id, data))
        return done[0]

    async def _pull(self, peer: PeerId, batch: list[bytes], stats: dict) -> int:
        """Stream ``batch`` from ``peer``, landing each verified chunk; returns how many
        it sent before the first it lacks.  ChunkError if one does not verify."""
        rpc = self.shards.host.rpc
        async with self._landing(peer, stats) as (send, done):
            async with rpc.stream(peer, "shards.chunks", {"model": self.manifest.id, "ids": batch},
                                  timeout=_CALL_TIMEOUT) as stream:
                ids = iter(batch)
                async for data in stream:  # one item per id asked, None where it has none
                    if data is None:
                        break
                    chunk_id = next(ids, None)
                    if chunk_id is None or not isinstance(data, bytes):
                        raise ChunkError("an item that is not a chunk asked for")
                    await send.send((chunk_id, data))
        return done[0]

    def _landed(self, chunk_id: bytes) -> None:
        self.wanted.discard(chunk_id)
        if self.writer is None:
            self._settled([chunk_id])
        if not self.wanted:
            self._finished.cancel()  # slower copies still in flight are not needed

    def _settle(self) -> None:
        """In the trio thread: count what the writer has made durable."""
        while self._durable:
            self._settled(self._durable.popleft())

    def _settled(self, chunk_ids: list[bytes]) -> None:
        before = self.progress.have_bytes
        for chunk_id in chunk_ids:
            if chunk_id in self.unsettled:
                self.unsettled.discard(chunk_id)
                self.progress.have_bytes += self.sizes[chunk_id]
        if self.on_progress and self.progress.have_bytes != before:
            self.on_progress(self.progress)
