"""The crdt service on a fake host: its control methods, its disk, its provider records."""

from contextlib import asynccontextmanager

import pytest
import trio
from fakehost import FakeHost, FakeProviders

from crdt.document import doc_id
from meshd.identity import Identity
from meshd.rpc import InvalidArgument, NotFound
from meshd.services.crdt import Crdt
from meshd.services.crdt.config import CrdtSection
from meshd.services.crdt.service import PROVIDER_PREFIX


@asynccontextmanager
async def running(host, providers, config=None):
    service = Crdt(host, config or CrdtSection(), providers=providers)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            yield service, service.control_methods()
            nursery.cancel_scope.cancel()
    finally:
        service.close()


async def test_a_document_written_through_control_reads_back_and_is_announced(tmp_path):
    host = FakeHost(tmp_path)
    providers = FakeProviders(host.peer_id)
    async with running(host, providers) as (_, control):
        await control["crdt.open"]({"doc": "notes", "create": True}, None)
        await control["crdt.write"]({"doc": "notes", "ops": [["set", ["lr"], 0.1], ["inc", ["step"], 3]]}, None)
        assert (await control["crdt.get"]({"doc": "notes"}, None))["value"] == {"lr": 0.1, "step": 3}
        with trio.fail_after(5):
            await providers.wait_for(PROVIDER_PREFIX + doc_id(host.peer_id.key, "notes"))


async def test_documents_and_their_changes_survive_a_restart(tmp_path):
    host = FakeHost(tmp_path)
    providers = FakeProviders(host.peer_id)
    async with running(host, providers) as (_, control):
        await control["crdt.open"]({"doc": "notes", "create": True}, None)
        await control["crdt.write"]({"doc": "notes", "ops": [["set", ["a"], "b"]]}, None)
    async with running(host, providers) as (_, control):
        [info] = await control["crdt.ls"]({}, None)
        assert info["doc"] == f"{host.peer_id}/notes" and info["changes"] == 1
        assert (await control["crdt.get"]({"doc": "notes", "path": ["a"]}, None))["value"] == "b"


async def test_opening_anothers_document_asks_its_owner_and_gives_up_after_the_timeout(tmp_path):
    host = FakeHost(tmp_path)
    owner = Identity.generate().peer_id
    async with running(host, FakeProviders(host.peer_id), CrdtSection(join_timeout=0.5)) as (_, control):
        with trio.fail_after(5):
            info = await control["crdt.open"]({"doc": f"{owner}/notes"}, None)
        assert info["owner"] == str(owner) and info["changes"] == 0
        assert owner in host.dialed  # the owner keeps its documents: the first replica tried


async def test_bad_requests_are_named_errors(tmp_path):
    host = FakeHost(tmp_path)
    async with running(host, FakeProviders(host.peer_id)) as (_, control):
        with pytest.raises(InvalidArgument, match="create it first"):
            await control["crdt.open"]({"doc": "missing"}, None)
        with pytest.raises(NotFound, match="open it first"):
            await control["crdt.get"]({"doc": "missing"}, None)
        await control["crdt.open"]({"doc": "notes", "create": True}, None)
        with pytest.raises(InvalidArgument, match="operation"):
            await control["crdt.write"]({"doc": "notes", "ops": [["explode", ["a"]]]}, None)
        with pytest.raises(InvalidArgument, match="ops must be a list"):
            await control["crdt.write"]({"doc": "notes", "ops": []}, None)
