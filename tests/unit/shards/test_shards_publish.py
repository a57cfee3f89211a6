"""The shards service on a fake host (documents from the crdt service): a file published and
written back through the control methods is the same file, a publish streams its chunks under
a pin of its own (a model larger than the store is StoreFull, not a manifest with holes), and
a publish cut short leaves no pin behind."""

from __future__ import annotations

import hashlib
import json
import struct
from contextlib import asynccontextmanager

import pytest
import trio
from fakehost import FakeHost, FakeProviders, FakeRecords

from meshd.rpc import InvalidArgument
from meshd.services.crdt import Crdt
from meshd.services.crdt.config import CrdtSection
from meshd.services.shards import ChunkStore, Shards, ShardsSection
from meshd.services.shards import store as store_module
from meshd.services.shards.service import _PUBLISHING


@asynccontextmanager
async def running(tmp_path, **config):
    host = FakeHost(tmp_path)
    providers = FakeProviders(host.peer_id)
    crdt = Crdt(host, CrdtSection(), providers=providers)
    shards = Shards(host, ShardsSection(lane=False, **config), providers=providers,
                    records=FakeRecords(host.identity), documents=crdt)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(crdt.run)
            await nursery.start(shards.run)
            yield shards, shards.control_methods()
            nursery.cancel_scope.cancel()
    finally:
        shards.close()
        crdt.close()


def a_file(path, tensors: int = 6, size: int = 3000) -> bytes:
    """A .safetensors file with metadata first, tensors in reverse name order, odd padding."""
    header, data, offset = {"__metadata__": {"step": "1200", "format": "pt"}}, b"", 0
    for i in reversed(range(tensors)):
        blob = bytes([i]) * size
        header[f"t{i}"] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        data, offset = data + blob, offset + size
    raw = json.dumps(header, indent=1).encode() + b"   "
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path.read_bytes()


async def test_a_file_published_and_fetched_through_control_is_the_same_file(tmp_path):
    source, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    original = a_file(source)
    async with running(tmp_path / "node") as (shards, control):
        info = await control["shards.publish"]({"path": str(source), "name": "run/ckpt"}, None)
        assert info["tensors"] == 6 and info["version"] == 1
        items = [item async for item in control["shards.fetch"]({"ref": "run/ckpt", "out": str(out)}, None)]
        assert items[-1]["done"] and items[-1]["id"] == info["id"]
        assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(original).digest()
        [manifest] = shards.manifests()
        assert manifest.metadata == {"step": "1200", "format": "pt"} and manifest.format_version == 2
        assert [name for _, name, *_ in shards.store.pins()] == ["run/ckpt@1"]  # no publishing pin left


async def test_a_model_larger_than_the_store_is_refused_and_leaves_no_pin(tmp_path, monkeypatch):
    """Three 5 MiB tensors are six chunks (4 + 1 MiB each), stored 4 MiB at a time: once
    10 MiB are in, the next 4 do not fit in 12, and the publish's pin keeps gc from
    making room by evicting the model's own first chunks (which would "succeed" with holes)."""
    monkeypatch.setattr(store_module, "STREAM_WINDOW", 8 << 20)  # batches of 4 MiB
    source = tmp_path / "big.safetensors"
    a_file(source, tensors=3, size=5 << 20)
    async with running(tmp_path / "node", max_bytes=12 << 20) as (shards, control):
        with pytest.raises(InvalidArgument, match="do not fit"):
            await control["shards.publish"]({"path": str(source), "name": "big"}, None)
        assert shards.manifests() == [] and shards.store.pins() == []
        assert shards.store.total_bytes() == 10 << 20  # what was stored stays, collectable


async def test_a_publish_cut_short_leaves_no_pin_after_a_restart(tmp_path):
    with ChunkStore(tmp_path / "node" / "chunks", max_bytes=1 << 30) as store:
        store.pin(b"\x07" * 32, [b"\x01" * 32], f"{_PUBLISHING}gpt@3")
        store.pin(b"\x08" * 32, [b"\x02" * 32], "gpt@2")
    async with running(tmp_path / "node") as (shards, _):
        assert [name for _, name, *_ in shards.store.pins()] == ["gpt@2"]
