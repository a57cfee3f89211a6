"""The client's ``shards.*`` methods: publish and fetch models."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .base import ControlClient

if TYPE_CHECKING:  # annotations only: meshctl imports this without trio
    from ..rpc import ResponseStream


class ShardsMethods(ControlClient):
    async def publish_model(self, path: str | Path, name: str, version: int | None = None) -> dict:
        """Have the daemon publish the ``.safetensors`` file at ``path`` as ``name``
        (version: one above the registry's highest unless given); returns its
        id, name, version, bytes, chunks, tensors, publisher, created."""
        arg = {"path": str(Path(path).expanduser().resolve()), "name": name, "version": version}
        return await self.request("shards.publish", arg, timeout=None)

    def fetch_model(self, ref: str, out: str | Path | None = None) -> ResponseStream:
        """``async with client.fetch_model("run42/gpt@latest", "gpt.safetensors") as items``:
        progress dicts (``total_bytes``, ``have_bytes``: stored durably, ``fetched_bytes``,
        ``providers``...) while the daemon pulls into its store, then ``{"done": True,
        id, ...}``.  With ``out`` the daemon also writes the model there as a
        ``.safetensors`` file as the chunks arrive (``out.part`` until whole; not fsynced:
        the durable copy is the store's).  ``ref`` is NAME, NAME@VERSION, NAME@latest or a
        hex id.  Tensors in a process of their own: ``node.service("shards").fetch(ref,
        store=False)`` in that process."""
        arg = {"ref": ref, "out": None if out is None else str(Path(out).expanduser().resolve())}
        return self.stream("shards.fetch", arg)

    async def models(self) -> list[dict]:
        """The models the daemon keeps, with how many of their bytes are present."""
        return await self.request("shards.ls")
