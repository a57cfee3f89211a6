"""Model names in the DHT: the first to publish under a name owns it, the owner lets
others publish, a node refuses a name whose owner changed, names are kept alive."""

import msgpack
import pytest
from fakehost import FakeRecords

from dht.names import name_key
from dht.records import RecordError
from meshd.identity import Identity
from meshd.rpc import PermissionDenied
from meshd.services.shards.errors import FetchError
from meshd.services.shards.names import (MAX_VERSIONS, NAME_TTL, KnownOwners, ModelNames, Version,
                                         decode_versions, encode_versions)


@pytest.fixture
def nodes(tmp_path):
    """Three nodes' ModelNames over one shared record store (one replica)."""
    store, made = {}, []
    for name in "abc":
        identity = Identity.generate()
        made.append(ModelNames(FakeRecords(identity, store), identity, KnownOwners(tmp_path / f"{name}.sqlite")))
    yield made
    for names in made:
        names.owners.close()


def version(n: int, publisher) -> Version:
    return Version(bytes([n]) * 32, 1000 * n, 1_700_000_000 + n, publisher.key)


async def test_a_name_published_on_one_node_resolves_on_another(nodes):
    a, b, _ = nodes
    me = a._identity.peer_id
    await a.add_version("run42/gpt", 1, version(1, me))
    await a.add_version("run42/gpt", 2, version(2, me))
    named = await b.get("run42/gpt")
    assert named.claim.owner == me.key
    assert named.version("latest") == version(2, me) and named.version("1") == version(1, me)
    assert named.version("3") is None and named.version("x") is None
    assert await b.get("run42/other") is None


async def test_only_the_owner_and_those_it_allows_publish_under_a_name(nodes):
    a, b, _ = nodes
    pa, pb = a._identity.peer_id, b._identity.peer_id
    await a.add_version("run42/gpt", 1, version(1, pa))
    with pytest.raises(PermissionDenied, match=f"meshctl shards allow run42/gpt {pb}"):
        await b.add_version("run42/gpt", 2, version(2, pb))
    with pytest.raises(PermissionDenied, match="only the owner"):
        await b.allow("run42/gpt", pb)
    await a.allow("run42/gpt", pb)
    await b.add_version("run42/gpt", 2, version(2, pb))
    named = await a.get("run42/gpt")
    assert sorted(named.versions) == [1, 2] and named.versions[2].publisher == pb.key
    await a.allow("run42/gpt", pb, revoke=True)
    with pytest.raises(PermissionDenied):
        await b.add_version("run42/gpt", 3, version(3, pb))
    assert sorted((await a.get("run42/gpt")).versions) == [1, 2]  # the owner's new claim kept b's version


async def test_a_node_refuses_a_name_whose_owner_changed_until_told_to_forget(nodes):
    a, b, c = nodes
    await a.add_version("run42/gpt", 1, version(1, a._identity.peer_id))
    assert (await c.get("run42/gpt")).claim.owner == a._identity.peer_id.key  # c remembers a
    c._records.store.pop(name_key("run42/gpt"))  # a's record lapsed everywhere
    await b.add_version("run42/gpt", 1, version(9, b._identity.peer_id))  # and b claimed the name
    with pytest.raises(FetchError, match=f"now claimed by {b._identity.peer_id}.*--forget-owner"):
        await c.get("run42/gpt")
    assert c.owners.forget("run42/gpt")
    assert (await c.get("run42/gpt")).claim.owner == b._identity.peer_id.key


async def test_refresh_republishes_names_this_node_publishes_under_when_half_their_life_is_gone(nodes):
    a, b, _ = nodes
    await a.add_version("run42/gpt", 1, version(1, a._identity.peer_id))
    assert await a.refresh() == 0  # fresh
    key = name_key("run42/gpt")
    record = a._records.store[key]
    await a._records.put(key, record.value, ttl=NAME_TTL / 2 - 60)  # the same, with less than half its life
    assert await b.refresh() == 0  # b does not publish under it
    assert await a.refresh() == 1
    assert a._records.store[key].expires >= record.expires
    assert a.owners.ours() == ["run42/gpt"] and b.owners.ours() == []


def test_versions_round_trip_keep_the_newest_and_refuse_malformed_payloads():
    publisher = Identity.generate().peer_id
    versions = {n: version(n % 250, publisher) for n in range(1, MAX_VERSIONS + 11)}
    decoded = decode_versions(encode_versions(versions))
    assert sorted(decoded) == list(range(11, MAX_VERSIONS + 11)) and decoded[20] == versions[20]
    for bad in [b"\xc1", msgpack.packb({1: 2}), msgpack.packb([[1, b"x", 1, 1, b"y"]]),
                msgpack.packb([[-1, bytes(32), 1, 1, bytes(32)]])]:
        with pytest.raises(RecordError):
            decode_versions(bad)
