"""Model shards between in-process nodes over QUIC: publish on one, fetch on
others by name or id, from several providers, past a provider that sends
corrupt chunks, and fetching only what a node lacks."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import torch
import trio

import meshd
from meshd import Config
from meshd.services.shards.format import chunks_changed
from meshd.services.shards.service import _FIRST_BATCH

torch.manual_seed(0)


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(4096, 256), torch.nn.Linear(256, 1024),
                               torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 1024))  # ~7.5 MB


async def open_nodes(stack: AsyncExitStack, tmp_path, names: str, *, lane: bool = True) -> list[meshd.Node]:
    """Nodes sharing the first node's model registry; the rest bootstrap through it.
    Without ``lane`` the others fetch over QUIC only."""
    first = await stack.enter_async_context(meshd.open_node(tmp_path / names[0], listen="127.0.0.1:0"))
    config = Config()
    config.shards.registry = f"{first.peer_id}/models"
    config.shards.lane = lane
    rest = [await stack.enter_async_context(meshd.open_node(
        tmp_path / name, listen="127.0.0.1:0", bootstrap=[str(first.address)], config=config))
        for name in names[1:]]
    for node in rest:
        await node.connect(first.address)
    return [first, *rest]


async def test_publish_then_fetch_by_name_gives_the_same_model(tmp_path):
    async with AsyncExitStack() as stack:
        a, b = await open_nodes(stack, tmp_path, "ab")
        source = model()
        manifest = await a.service("shards").publish(source.state_dict(), name="run42/gpt")
        assert manifest.version == 1
        loaded = await b.service("shards").fetch("run42/gpt@latest")
        copy = model()
        copy.load_state_dict(loaded)
        x = torch.randint(0, 4096, (4, 16))
        assert torch.equal(copy(x), source(x))
        assert b.service("shards").fetches[manifest.id].fetched_bytes == manifest.total_size
        again = await b.service("shards").pull(manifest.id.hex())  # by id; nothing left to fetch
        assert again.id == manifest.id


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "quic"])
async def test_many_providers_and_a_corrupt_one(tmp_path, lane):
    async with AsyncExitStack() as stack:
        a, bad, d = await open_nodes(stack, tmp_path, "acd", lane=lane)
        big = torch.nn.Sequential(model(), torch.nn.Linear(1024, 2048))  # 7 chunks of <= 4 MiB
        manifest = await a.service("shards").publish(big.state_dict(), name="gpt")
        assert len(manifest.chunks) >= 2 * 2  # each provider's first batch is 2 chunks
        await bad.service("shards").pull("gpt")

        good = bad.service("shards").store.get
        bad.service("shards").store.get = lambda chunk_id, **kw: bytes([good(chunk_id)[0] ^ 1]) + good(chunk_id)[1:]

        await d.service("shards").pull("gpt@1")
        progress = d.service("shards").fetches[manifest.id]
        assert progress.fetched_bytes == manifest.total_size
        states = {peer: p["state"] for peer, p in progress.providers.items()}
        assert states[str(bad.peer_id)].startswith("dropped") and "hash" in states[str(bad.peer_id)], states
        assert states[str(a.peer_id)] == "done"
        assert {p["path"] for p in progress.providers.values()} == {"lane" if lane else "quic"}
        assert d.service("shards").store.missing([c.id for c in manifest.chunks], verify=True) == []


def mixed_state() -> dict[str, torch.Tensor]:
    """Tensors of every shape a chunk can take: large ones cut into 4 MiB pieces (received
    straight into their place), small ones packed together, the same bytes twice (one chunk,
    two places), a bool, a bfloat16, a 0-d and an empty tensor."""
    big = torch.randn(3 << 20)  # 12 MiB: three pieces
    return {**model().state_dict(), "big": big, "big_twin": big.clone(), "step": torch.tensor(7),
            "mask": torch.rand(333) > 0.5, "scale": torch.randn(5).bfloat16(), "none": torch.zeros(0, 4)}


def same_tensors(got: dict, expected: dict) -> bool:
    return got.keys() == expected.keys() and all(
        got[k].dtype == v.dtype and got[k].shape == v.shape
        and torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
        for k, v in expected.items())


def stores_nothing(node: meshd.Node) -> bool:
    shards = node.service("shards")
    chunk_files = [p for p in shards.store.root.glob("??/*")]
    return (shards.store.total_bytes(), chunk_files, shards.manifests(), shards.store.pins()) == (0, [], [], [])


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "quic"])
async def test_a_fetch_to_memory_gives_the_tensors_and_stores_nothing(tmp_path, lane):
    async with AsyncExitStack() as stack:
        a, b, c = await open_nodes(stack, tmp_path, "abc", lane=lane)
        state = mixed_state()
        manifest = await a.service("shards").publish(state, name="run42/gpt")
        assert len({ch.id for ch in manifest.chunks}) < len(manifest.chunks)  # the twin's pieces

        got = await b.service("shards").fetch("run42/gpt@latest", store=False)
        assert same_tensors(got, state)
        assert stores_nothing(b)
        progress = b.service("shards").fetches[manifest.id]
        assert progress.have_bytes == manifest.total_size
        assert progress.fetched_bytes == sum({ch.id: ch.length for ch in manifest.chunks}.values())
        assert {p["path"] for p in progress.providers.values()} == {"lane" if lane else "quic"}

        # b is not a provider: c finds a alone, and fetches from it
        await c.service("shards").pull("run42/gpt")
        assert list(c.service("shards").fetches[manifest.id].providers) == [str(a.peer_id)]


async def test_a_fetch_to_memory_reads_the_chunks_the_node_has(tmp_path):
    async with AsyncExitStack() as stack:
        a, b = await open_nodes(stack, tmp_path, "ab")
        source = model()
        first = await a.service("shards").publish(source.state_dict(), name="gpt")
        await b.service("shards").pull("gpt")
        stored = b.service("shards").store.total_bytes()
        with torch.no_grad():
            source[3].weight.mul_(0.5)  # about half the bytes change
        second = await a.service("shards").publish(source.state_dict(), name="gpt")
        got = await b.service("shards").fetch("gpt@2", store=False)
        assert same_tensors(got, source.state_dict())
        changed = set(chunks_changed(first, second))
        assert b.service("shards").fetches[second.id].fetched_bytes == sum(
            ch.length for ch in second.chunks if ch.id in changed)  # only what it lacked
        assert b.service("shards").store.total_bytes() == stored  # and nothing of it kept
        assert [m.id for m in b.service("shards").manifests()] == [first.id]


async def test_a_fetch_to_memory_past_a_corrupt_provider(tmp_path):
    """A corrupt chunk opened in its place in a tensor is caught, and its place refilled
    from a good provider: the result is the model, and the bad provider is dropped."""
    async with AsyncExitStack() as stack:
        a, bad, d = await open_nodes(stack, tmp_path, "acd")
        state = mixed_state()
        manifest = await a.service("shards").publish(state, name="gpt")
        await bad.service("shards").pull("gpt")
        good = bad.service("shards").store.get
        bad.service("shards").store.get = lambda chunk_id, **kw: bytes([good(chunk_id)[0] ^ 1]) + good(chunk_id)[1:]

        got = await d.service("shards").fetch("gpt", store=False)
        assert same_tensors(got, state) and stores_nothing(d)
        states = {peer: p["state"] for peer, p in d.service("shards").fetches[manifest.id].providers.items()}
        assert states[str(bad.peer_id)].startswith("dropped") and "hash" in states[str(bad.peer_id)], states


async def test_a_fetch_into_a_models_own_tensors_loads_it_in_place(tmp_path):
    async with AsyncExitStack() as stack:
        a, b = await open_nodes(stack, tmp_path, "ab")
        source = model()
        await a.service("shards").publish(source.state_dict(), name="gpt")
        copy = model()  # initialized otherwise
        target = copy.state_dict()
        with pytest.raises(ValueError, match="exactly the model's tensors"):
            await b.service("shards").fetch("gpt", store=False, into={**target, "extra": torch.zeros(1)})
        with pytest.raises(ValueError, match="0.weight"):
            await b.service("shards").fetch("gpt", store=False, into={**target, "0.weight": torch.zeros(3)})
        assert stores_nothing(b)  # refused before anything was fetched or kept
        got = await b.service("shards").fetch("gpt", store=False, into=target)
        assert got is target and all(got[k].data_ptr() == v.data_ptr() for k, v in copy.state_dict().items())
        x = torch.randint(0, 4096, (4, 16))
        assert torch.equal(copy(x), source(x)) and stores_nothing(b)


async def test_a_fetch_with_the_store_gives_the_tensors_and_keeps_the_model(tmp_path):
    async with AsyncExitStack() as stack:
        a, b = await open_nodes(stack, tmp_path, "ab")
        state = mixed_state()
        manifest = await a.service("shards").publish(state, name="gpt")
        assert same_tensors(await b.service("shards").fetch("gpt"), state)
        shards = b.service("shards")
        assert shards.store.missing([ch.id for ch in manifest.chunks], verify=True) == []
        assert [m.id for m in shards.manifests()] == [manifest.id]
        assert same_tensors(await shards.fetch("gpt", store=False), state)  # from its store alone
        assert shards.fetches[manifest.id].fetched_bytes == 0


async def test_a_stalled_provider_does_not_hold_up_the_end(tmp_path):
    async with AsyncExitStack() as stack:
        a, stalled, d = await open_nodes(stack, tmp_path, "asd", lane=False)
        manifest = await a.service("shards").publish(model().state_dict(), name="gpt")
        await stalled.service("shards").pull("gpt")
        assert len(manifest.chunks) > _FIRST_BATCH  # so the stalled provider is given a batch

        async def stall(arg, ctx):
            await trio.sleep_forever()
            yield None
        stalled.rpc.unregister("shards.chunks")
        stalled.rpc.register("shards.chunks", stall)

        with trio.fail_after(20):  # far below the 120 s a stalled call may take
            await d.service("shards").pull(manifest.id.hex())
        progress = d.service("shards").fetches[manifest.id]
        assert progress.have_bytes == manifest.total_size
        assert progress.providers[str(stalled.peer_id)]["bytes"] == 0
        assert d.service("shards").store.missing([c.id for c in manifest.chunks], verify=True) == []


async def test_a_new_version_fetches_only_the_changed_chunks(tmp_path):
    async with AsyncExitStack() as stack:
        a, b = await open_nodes(stack, tmp_path, "ab")
        source = model()
        first = await a.service("shards").publish(source.state_dict(), name="gpt")
        await b.service("shards").pull("gpt")
        with torch.no_grad():
            source[3].weight.mul_(0.5)  # the last Linear: about half the bytes
        second = await a.service("shards").publish(source.state_dict(), name="gpt")
        assert second.version == 2
        await b.service("shards").pull("gpt@2")  # the registry may lag: a miss makes it catch up
        changed = chunks_changed(first, second)
        expected = sum(c.length for c in second.chunks if c.id in set(changed))
        assert b.service("shards").fetches[second.id].fetched_bytes == expected < second.total_size * 0.6


async def test_an_unknown_model_is_a_clear_error(tmp_path):
    async with AsyncExitStack() as stack:
        _, b = await open_nodes(stack, tmp_path, "ab")
        with pytest.raises(meshd.services.shards.service.FetchError, match="has no nope@latest"):
            await b.service("shards").pull("nope")
        with pytest.raises(meshd.services.shards.service.FetchError, match="nobody provides|no provider"):
            await b.service("shards").pull("ab" * 32)


async def test_a_name_resolves_on_any_node_through_the_dht_and_only_its_owner_lets_others_publish(tmp_path):
    async with AsyncExitStack() as stack:  # no registry configured: each node has its own
        a = await stack.enter_async_context(meshd.open_node(tmp_path / "a", listen="127.0.0.1:0"))
        b, c = [await stack.enter_async_context(meshd.open_node(
            tmp_path / name, listen="127.0.0.1:0", bootstrap=[str(a.address)])) for name in "bc"]
        for node in (b, c):
            await node.connect(a.address)
        source = model()
        first = await a.service("shards").publish(source.state_dict(), name="run42/gpt")
        copy = model()
        copy.load_state_dict(await c.service("shards").fetch("run42/gpt@latest", store=False))
        x = torch.randint(0, 4096, (4, 16))
        assert torch.equal(copy(x), source(x))

        with pytest.raises(meshd.PermissionDenied, match=f"belongs to {a.peer_id}"):
            await b.service("shards").publish(source.state_dict(), name="run42/gpt")
        assert b.service("shards").manifests() == []  # refused before anything was stored
        await a.service("shards").names.allow("run42/gpt", b.peer_id)
        with torch.no_grad():
            source[3].weight.mul_(0.5)
        second = await b.service("shards").publish(source.state_dict(), name="run42/gpt")
        assert second.version == 2
        assert (await c.service("shards").pull("run42/gpt@latest")).id == second.id
        assert (await c.service("shards").pull("run42/gpt@1")).id == first.id
