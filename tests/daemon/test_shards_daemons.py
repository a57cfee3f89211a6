"""Model shards between real ``meshd`` processes, driven by ``meshctl shard``
and the client library: a fetch SIGKILLed halfway resumes with only what is
missing, and the file written is the file published (a file the safetensors
library saved with ``__metadata__`` too, byte for byte), found by its name in
the DHT, where only its owner and those it allows publish."""

from __future__ import annotations

import filecmp
import hashlib

import torch
import trio

import meshd
from meshd.services.shards.format import encode_tensors, write_safetensors
from meshd.services.shards.store import STREAM_GROUP
from test_daemons import daemons  # noqa: F401  (the fixture)
from test_dht_daemons import start

CONFIG = {"transport": {"idle_timeout": 3.0, "keepalive_interval": 0.5, "handshake_timeout": 2.0}}


def safetensors_file(path, megabytes: int) -> None:
    generator = torch.Generator().manual_seed(1)
    tensors = {f"layer{i}.weight": torch.randn(1024, 1024, generator=generator) for i in range(megabytes // 4)}
    tensors["step"] = torch.tensor(7)
    layout, chunks = encode_tensors(tensors)
    write_safetensors(layout, dict(zip([c.id for c in layout.chunks], chunks)), path)


async def test_a_fetch_killed_halfway_resumes_with_what_is_missing(daemons, tmp_path):  # noqa: F811
    with trio.fail_after(120):
        source = tmp_path / "gpt.safetensors"
        # Larger than the group a fetch makes durable (and reports) at once: where the
        # network outruns the disk, a model of one group is reported whole, at its end.
        safetensors_file(source, (STREAM_GROUP >> 20) + 64)
        [a] = await start(daemons, ["a"], config=CONFIG)
        # QUIC only: the lane would move all 64 MiB before the kill lands.
        shared = {**CONFIG, "shards": {"registry": f"{a.peer_id}/models", "lane": False}}
        [b] = await start(daemons, ["b"], config=shared, bootstrap=[str(a.address)])
        published = a.meshctl("shard", "publish", str(source), "--name", "run42/gpt")
        assert published["version"] == 1 and published["bytes"] > STREAM_GROUP + (64 << 20)

        async with meshd.connect(b.data_dir) as client:
            async with client.fetch_model("run42/gpt@latest") as items:
                first = await items.__anext__()  # sent after the first chunk is on disk
                b.kill()  # while it is still pulling
        assert 0 < first["have_bytes"] < first["total_bytes"]
        [b] = await start(daemons, ["b"], config=shared, bootstrap=[str(a.address)])

        out = tmp_path / "fetched.safetensors"
        done = b.meshctl("shards", "fetch", "run42/gpt", "-o", str(out), timeout=60)
        assert done["done"] and done["id"] == published["id"]
        assert 0 < done["fetched_bytes"] <= published["bytes"] - first["have_bytes"]
        assert filecmp.cmp(source, out, shallow=False)
        human = b.meshctl_raw("shard", "fetch", "run42/gpt@1")  # the progress bar's path
        assert human.returncode == 0 and human.stdout.startswith("fetched run42/gpt@1 "), human
        [kept] = b.meshctl("shards", "ls")  # the group's name; "shard" is its first one
        assert kept["present_bytes"] == kept["bytes"] and kept["name"] == "run42/gpt"
        collected = b.meshctl("shard", "gc", "--unpin", published["id"])
        assert collected["removed"] == published["chunks"] and collected["bytes"] == 0


async def test_a_file_with_metadata_comes_back_byte_for_byte(daemons, tmp_path):  # noqa: F811
    """Saved by the safetensors library (tensors by dtype then name, ``__metadata__``,
    padding), published on one daemon, fetched on another: the same sha256."""
    from safetensors.torch import save_file
    with trio.fail_after(60):
        generator = torch.Generator().manual_seed(2)
        tensors = {f"layer{i}.weight": torch.randn(512, 1024, generator=generator) for i in range(6)}
        tensors |= {"embed.weight": torch.randn(1000, 64, generator=generator).bfloat16(),
                    "ln.bias": torch.zeros(1024).half(), "step": torch.tensor(1200), "mask": torch.ones(3, dtype=bool)}
        source = tmp_path / "ckpt.safetensors"
        save_file(tensors, source, metadata={"step": "1200", "format": "pt"})
        [a] = await start(daemons, ["a"], config=CONFIG)
        [b] = await start(daemons, ["b"], config=CONFIG, bootstrap=[str(a.address)])  # no registry: the DHT
        published = a.meshctl("shards", "publish", str(source), "--name", "run42/ckpt")
        out = tmp_path / "fetched.safetensors"
        done = b.meshctl("shards", "fetch", "run42/ckpt@latest", "-o", str(out), timeout=60)
        assert done["done"] and done["id"] == published["id"] and done["tensors"] == len(tensors)
        assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(source.read_bytes()).digest()

        name = b.meshctl("shards", "name", "run42/ckpt")
        assert name["owner"] == str(a.peer_id) and name["versions"]["1"]["id"] == published["id"]
        refused = b.meshctl_raw("shards", "publish", str(source), "--name", "run42/ckpt")
        assert refused.returncode != 0 and refused.stderr.count("\n") == 1
        assert f"belongs to {a.peer_id}" in refused.stderr
        assert a.meshctl("shards", "allow", "run42/ckpt", str(b.peer_id))["writers"] == [str(b.peer_id)]
        assert b.meshctl("shards", "publish", str(source), "--name", "run42/ckpt")["version"] == 2
