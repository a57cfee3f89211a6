"""The control-socket methods for model shards (``shards.*``).

The daemon reads and writes ``.safetensors`` files named by the caller (the
control socket only admits this user, so paths are the user's own).
"""

from __future__ import annotations

import os
import trio

from dht.network import DhtError

from ...identity import PeerId
from ...rpc import InvalidArgument, NotFound, PermissionDenied, Unavailable
from ...rpc.args import field, optional, peer_field
from .errors import FetchError
from .format import ManifestError
from .store import StoreFull

PROGRESS_EVERY = 0.25  # seconds between progress items of shards.fetch


def _info(manifest, present: int | None = None) -> dict:
    info = {"id": manifest.id.hex(), "name": manifest.name, "version": manifest.version,
            "bytes": manifest.total_size, "chunks": len(manifest.chunks), "tensors": len(manifest.tensors),
            "publisher": str(PeerId(manifest.publisher)), "created": manifest.created}
    if present is not None:
        info["present_bytes"] = present
    return info


def _str(arg: object, name: str, *, required: bool = True) -> str | None:
    value = field(arg, name, str) if required else optional(arg, name, str)
    if value == "":
        raise InvalidArgument(f"{name} must not be empty")
    return value


def control_methods(shards) -> dict:
    """``shards.publish``, ``shards.fetch`` (a server stream of progress),
    ``shards.ls``, ``shards.unpin``, ``shards.gc``, ``shards.name`` (a name's
    owner, writers and versions in the DHT) and ``shards.allow`` (the owner
    lets a peer publish under a name, or no longer), bound to ``shards``, the
    :class:`~meshd.services.shards.Shards` service (not imported here: it imports this module)."""

    async def publish(arg, ctx):
        path, name = _str(arg, "path"), _str(arg, "name")
        version = arg.get("version")
        if version is not None and (type(version) is not int or version < 0):
            raise InvalidArgument("version must be a non-negative integer")
        try:
            manifest = await shards.publish(os.path.expanduser(path), name=name, version=version)
        except (OSError, ValueError, StoreFull) as exc:
            raise InvalidArgument(f"could not publish {path}: {exc}") from None
        return _info(manifest)

    async def fetch(arg, ctx):
        ref, out = _str(arg, "ref"), _str(arg, "out", required=False)
        out = os.path.expanduser(out) if out else None  # written as the chunks arrive
        latest: list = []
        changed = trio.Event()

        def on_progress(progress) -> None:
            latest[:] = [progress.as_dict()]
            changed.set()

        result: dict = {}
        async with trio.open_nursery() as nursery:
            async def run() -> None:
                try:
                    result["manifest"] = await shards.pull(ref, on_progress=on_progress, out=out)
                except (FetchError, ManifestError, StoreFull) as exc:
                    result["error"] = str(exc)
                except OSError as exc:  # e.g. the file's folder does not exist, or the disk is full
                    result["invalid"] = f"could not fetch {ref}{f' to {out}' if out else ''}: {exc}"
                changed.set()
            nursery.start_soon(run)
            while not result:
                await changed.wait()
                changed = trio.Event()
                if latest and not result:
                    yield latest[0]
                    await trio.sleep(PROGRESS_EVERY)  # at most a few items per second
        if "error" in result:
            raise NotFound(result["error"])
        if "invalid" in result:
            raise InvalidArgument(result["invalid"])
        manifest = result["manifest"]
        progress = shards.fetches[manifest.id]
        yield {"done": True, **_info(manifest), "out": out, "fetched_bytes": progress.fetched_bytes,
               "providers": progress.providers}

    async def ls(arg, ctx):
        pins = await trio.to_thread.run_sync(shards.store.pins)  # a publish may hold the store a moment
        present = {model: have for model, _, _, _, have in pins}
        return [_info(m, present.get(m.id, 0)) for m in shards.manifests()]

    async def unpin(arg, ctx):
        try:
            model_id = bytes.fromhex(_str(arg, "id"))
        except ValueError:
            raise InvalidArgument("id must be hex") from None
        return {"unpinned": await shards.unpin(model_id)}

    async def gc(arg, ctx):
        target = arg.get("target_bytes") if isinstance(arg, dict) else None
        if target is not None and (type(target) is not int or target < 0):
            raise InvalidArgument("target_bytes must be a non-negative integer")
        removed, freed = await trio.to_thread.run_sync(shards.store.gc, target)
        return {"removed": removed, "freed_bytes": freed, "bytes": shards.store.total_bytes()}

    async def name(arg, ctx):
        name = _str(arg, "name")
        forgot = bool(arg.get("forget_owner")) and shards.names.owners.forget(name)
        try:
            named = await shards.names.get(name)
        except FetchError as exc:
            raise PermissionDenied(str(exc)) from None
        except DhtError as exc:
            raise Unavailable(f"could not look up {name} in the DHT: {exc}") from None
        if named is None:
            raise NotFound(f"no node has claimed the name {name} (or the DHT cannot reach its record)")
        return {"name": name, **named.as_dict(), "forgot_owner": forgot}

    async def allow(arg, ctx):
        name, peer = _str(arg, "name"), peer_field(arg, "peer")
        try:
            named = await shards.names.allow(name, peer, revoke=bool(arg.get("revoke")))
        except DhtError as exc:
            raise Unavailable(f"could not update {name} in the DHT: {exc}") from None
        return {"name": name, **named.as_dict()}

    return {"shards.publish": publish, "shards.fetch": fetch, "shards.ls": ls,
            "shards.unpin": unpin, "shards.gc": gc, "shards.name": name, "shards.allow": allow}
