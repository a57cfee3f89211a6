"""The DHT on the in-memory network: replicas, providers, modes, failures (10,000 nodes and
joining: tests/sim/test_dht_large.py).

Runs on trio's MockClock (the ``autojump_clock`` fixture): simulated latency
and timeouts cost no real time, so lookup durations count round trips.
"""

from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from dht.ids import Contact, key_id
from dht.network import ADD_PROVIDER, FIND_NODE, GET_VALUE, PUT_VALUE, Refused
from dht.node import DhtConfig
from dht.records import Record
from dht.simnet import SimNetwork, fill_tables, make_nodes, true_closest

QUORUM = DhtConfig().put_quorum

LATENCY = 0.005  # one way; a round trip is 10 ms of virtual time
RTT = 2 * LATENCY


@pytest.fixture
def small():
    net = SimNetwork(latency=0.0)
    nodes = make_nodes(net, 300, config=DhtConfig(request_timeout=0.1), seed=3)
    fill_tables(nodes, seed=3)
    return net, nodes


async def test_stale_replicas_are_corrected_after_a_get(small):
    net, nodes = small
    async with trio.open_nursery() as nursery:
        for node in nodes:
            node.start(nursery)
        key = b"/open/model-version"
        writer, reader = nodes[0], nodes[1]
        assert await writer.put(key, b"v1", seq=1) == QUORUM
        await trio.testing.wait_all_tasks_blocked()  # the other replicas, stored in the background
        holders = [net.nodes[pk] for pk in true_closest(nodes, key_id(key), 20)]
        assert all(h.records.get(key, writer.wall()).value == b"v1" for h in holders if h is not writer)
        v2 = await _signed(writer, key, b"v2", seq=2)
        holders[0].records.put(v2, writer.wall())  # the nearest replica alone learns of v2
        record = await reader.get(key)
        assert record.value == b"v2" and record.seq == 2
        await trio.testing.wait_all_tasks_blocked()
        now = writer.wall()
        values = [h.records.get(key, now) for h in holders if h is not reader]
        assert all(r is not None and r.value == b"v2" for r in values)
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def small_mesh(seed: int, config: DhtConfig | None = None):
    """(network, 12 nodes that all know each other, running), 5 ms one way; stopped on exit."""
    net = SimNetwork(latency=0.005)
    nodes = make_nodes(net, 12, seed=seed, **({"config": config} if config else {}))
    fill_tables(nodes, seed=seed)
    async with trio.open_nursery() as nursery:
        for node in nodes:
            node.start(nursery)
        yield net, nodes
        nursery.cancel_scope.cancel()


async def test_in_a_mesh_smaller_than_k_a_put_takes_one_round_trip_and_reaches_every_node(autojump_clock):
    async with small_mesh(4) as (net, nodes):
        started = trio.current_time()
        assert await nodes[0].put(b"/open/small", b"v") == QUORUM
        assert trio.current_time() - started == pytest.approx(2 * net.latency)  # no lookup first
        await net.settle()  # the rest, and the lookup, in the background
        assert all(n.records.get(b"/open/small", n.wall()) is not None for n in nodes)


async def test_a_put_answers_its_caller_before_it_sends_the_stores_beyond_its_quorum(autojump_clock):
    async with small_mesh(4) as (net, nodes):
        assert await nodes[0].put(b"/open/first", b"v") == QUORUM
        assert net.methods[PUT_VALUE] == QUORUM  # the caller runs on before the other stores start
        await net.settle()
        assert net.methods[PUT_VALUE] == len(nodes) - 1


async def test_a_small_mesh_put_looks_for_strangers_only_if_its_bucket_had_no_recent_lookup(autojump_clock):
    async with small_mesh(4) as (net, nodes):
        writer = nodes[0]
        far = [k for k in (b"/open/far-%d" % i for i in range(64))  # keys in the writer's farthest bucket
               if (int.from_bytes(key_id(k), "big") ^ writer.table.own_num).bit_length() == 256][:3]

        async def lookups_of_a_put(key: bytes) -> int:
            before = net.methods[FIND_NODE]
            await writer.put(key, b"v")
            await net.settle()
            return net.methods[FIND_NODE] - before

        assert await lookups_of_a_put(far[0]) > 0  # its bucket never looked through: a lookup
        assert await lookups_of_a_put(far[1]) == 0  # that lookup met whoever is there
        await trio.sleep(DhtConfig().recent_lookup)
        assert await lookups_of_a_put(far[2]) > 0


async def test_a_get_checks_only_records_that_are_not_copies_of_its_own(autojump_clock, monkeypatch):
    async with small_mesh(7) as (net, nodes):
        await nodes[0].put(b"/open/copies", b"v1", seq=1)
        await net.settle()
        reader = nodes[1]
        checked = []
        monkeypatch.setattr(reader.validators, "validate", lambda r, now: checked.append(r.seq))
        assert (await reader.get(b"/open/copies")).seq == 1
        assert checked == []  # every replica answered with the record the reader holds
        v2 = await _signed(nodes[0], b"/open/copies", b"v2", seq=2)
        for node in nodes[2:]:
            node.records.put(v2, node.wall())
        assert (await reader.get(b"/open/copies")).seq == 2
        assert checked and set(checked) == {2}


async def test_with_a_get_quorum_of_one_a_record_held_here_is_the_answer_without_asking(autojump_clock):
    async with small_mesh(5, DhtConfig(get_quorum=1)) as (net, nodes):
        await nodes[0].put(b"/open/held", b"v")
        await net.settle()
        holder, stranger = nodes[1], make_nodes(net, 1, config=DhtConfig(get_quorum=1), seed=6)[0]
        fill_tables(nodes + [stranger], seed=6)
        asked = net.methods[GET_VALUE]
        assert (await holder.get(b"/open/held")).value == b"v"
        assert net.methods[GET_VALUE] == asked
        assert (await stranger.get(b"/open/held")).value == b"v"  # holding none, it asks
        assert net.methods[GET_VALUE] > asked


async def test_a_get_whose_replicas_all_hold_the_record_asks_only_as_many_as_it_still_needs(autojump_clock):
    async with small_mesh(8) as (net, nodes):
        await nodes[0].put(b"/open/everywhere", b"v")
        await net.settle()  # all 12 hold it, the reader too
        for i, node in enumerate(nodes):  # answers arrive one by one, 1 ms apart
            net.slow[node.public_key] = 0.001 * i
        asked = net.methods[GET_VALUE]
        assert (await nodes[1].get(b"/open/everywhere")).value == b"v"
        # its own record and get_quorum - 1 answers: no query beyond them (5 before: each
        # answer freed a slot and the next contact was asked at once)
        assert net.methods[GET_VALUE] - asked == DhtConfig().get_quorum - 1


async def test_a_get_whose_replicas_agree_sends_the_record_only_to_asked_nodes_without_it(small):
    net, nodes = small
    async with trio.open_nursery() as nursery:
        for node in nodes:
            node.start(nursery)
        key = b"/open/agreed"
        await nodes[0].put(key, b"v")
        await trio.testing.wait_all_tasks_blocked()
        asked_before, stores_before = net.methods[GET_VALUE], net.methods[PUT_VALUE]
        assert (await nodes[1].get(key)).value == b"v"
        await trio.testing.wait_all_tasks_blocked()
        asked = net.methods[GET_VALUE] - asked_before
        pushed = net.methods[PUT_VALUE] - stores_before
        assert pushed <= asked - DhtConfig().get_quorum  # only to asked nodes that had no record
        nursery.cancel_scope.cancel()


async def _signed(node, key: bytes, value: bytes, seq: int) -> Record:
    from dht.records import sign_record

    return sign_record(key, value, public_key=node.public_key, sign=node._sign, seq=seq,
                       expires=int(node.wall() + 3600))


async def test_concurrent_lookups_of_one_target_share_their_queries(small):
    net, nodes = small
    src, target = nodes[5], key_id(b"shared")
    results = []

    async def look():
        results.append(await src.find_node(target))

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(look)
    shared_cost = src.messages_sent
    await src.find_node(target)
    single_cost = src.messages_sent - shared_cost
    assert results[0] == results[4]
    assert shared_cost <= 1.5 * single_cost  # five at once cost about what one costs, not five times


async def test_client_mode_nodes_query_but_are_never_stored(small):
    net, nodes = small
    client = nodes[7]
    client.server_mode = False
    for node in nodes:
        if node is not client:
            node.table.remove(client.contact)
    async with trio.open_nursery() as nursery:
        for node in nodes:
            node.start(nursery)
        found = await client.find_node(key_id(b"anything"))
        assert len(found) == 20
        assert await client.put(b"/open/from-a-client", b"x") == QUORUM
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert not any(client.contact in node.table for node in nodes)
    assert nodes[8].server_mode and any(nodes[8].contact in node.table for node in nodes)


async def test_providers_are_found_and_republishing_is_spread_out(small):
    net, nodes = small
    async with trio.open_nursery() as nursery:
        for node in nodes:
            node.start(nursery)
        provider = nodes[10]
        start = trio.current_time()
        keys = [b"shard-%d" % i for i in range(64)]
        stored = await provider.provide_many(keys)
        assert min(stored.values()) >= 15
        for seeker in nodes[20:25]:
            found = await seeker.find_providers(keys[3])
            assert [c.public_key for c in found] == [provider.public_key]
            assert found[0].addrs == provider.own_contact().addrs
        nursery.cancel_scope.cancel()
    interval = provider.config.provider_republish
    due = sorted(when - start for when in provider._provided.values())
    assert due[-1] - due[0] > interval * 0.25  # first republishes spread, not all at once
    assert all(interval * 0.5 <= t <= interval for t in due)


async def test_a_key_few_nodes_took_is_provided_again_soon_with_growing_waits(autojump_clock):
    """A node that provides in a mesh of three (or right after joining) reaches fewer
    than put_quorum nodes: it tries again after the maintenance interval, then twice
    that, ..., and keeps the normal republish once enough nodes take the key."""
    net = SimNetwork(latency=0.0)
    nodes = make_nodes(net, 3, config=DhtConfig(request_timeout=0.1), seed=4)
    fill_tables(nodes, seed=4)
    provider, cfg = nodes[0], nodes[0].config
    async with trio.open_nursery() as nursery:
        for node in nodes:
            node.start(nursery)
        start = trio.current_time()
        assert (await provider.provide_many([b"model"]))[b"model"] == 2  # the other two: below the quorum of 5
        assert provider._provided[b"model"] - start == cfg.maintenance_interval
        provider._provided[b"model"] = start + cfg.provider_republish  # as _republish_providers does, then
        provider._retry_thin({b"model": 1})  # taken by few again: the wait doubles
        assert provider._provided[b"model"] - start == 2 * cfg.maintenance_interval
        provider._provided[b"model"] = start + cfg.provider_republish
        provider._retry_thin({b"model": cfg.put_quorum})  # enough nodes: the normal republish stays
        assert b"model" not in provider._thin and provider._provided[b"model"] - start == cfg.provider_republish
        provider.unprovide(b"model")
        provider._retry_thin({b"model": 0})  # a provide that ended after the key was given up
        assert b"model" not in provider._provided and b"model" not in provider._thin
        nursery.cancel_scope.cancel()


async def test_a_provider_the_network_cannot_place_is_found_at_the_addresses_its_entry_gave(small):
    """A node that started a moment ago is a provider before its contact has spread: a
    seeker that found it through its provider entry can still dial it (find_peer)."""
    net, nodes = small
    async with trio.open_nursery() as nursery:
        for node in nodes:
            node.start(nursery)
        provider, seeker = nodes[11], nodes[30]
        await provider.provide_many([b"fresh"])

        async def nobody_knows(*args, **kwargs):  # the network has not heard of the provider yet
            return None

        seeker.table.remove(provider.own_contact())
        real_lookup, seeker._lookup = seeker._lookup, nobody_knows
        assert await seeker.find_peer(provider.public_key) is None
        seeker._lookup = real_lookup
        [found] = await seeker.find_providers(b"fresh")
        seeker.table.remove(provider.own_contact())
        seeker._lookup = nobody_knows
        contact = await seeker.find_peer(provider.public_key)
        assert contact is not None and contact.addrs == found.addrs == provider.own_contact().addrs
        nursery.cancel_scope.cancel()


async def test_add_provider_floods_are_rate_limited_per_peer(small):
    net, nodes = small
    target, flooder, other = nodes[0], nodes[1], nodes[2]
    msg = {"keys": [b"k%d" % i for i in range(16)], "ttl": 3600.0, "a": ["sim:1"]}
    refused = 0
    for _ in range(50):
        try:
            await target.handle(flooder.public_key, ADD_PROVIDER, msg)
        except Refused as exc:
            assert "slow down" in str(exc)
            refused += 1
    assert refused >= 35  # a burst of 200 keys, then nothing more within the same instant
    reply = await target.handle(other.public_key, ADD_PROVIDER, msg)
    assert reply["added"] == 16
    entries = target.providers.get(b"k0", target.wall())
    assert {c.public_key for c, _ in entries} == {flooder.public_key, other.public_key}


async def test_full_bucket_checks_its_oldest_entry_and_replaces_it_if_dead(autojump_clock):
    net = SimNetwork(latency=LATENCY)
    nodes = make_nodes(net, 400, config=DhtConfig(k=2, request_timeout=0.1), seed=9)
    me = nodes[0]
    far = [n for n in nodes[1:] if me.table.bucket_of(n.contact) == 255][:3]
    async with trio.open_nursery() as nursery:
        me.start(nursery)
        await me.handle(far[0].public_key, "dht.ping", {"from": ["sim:a"]})
        await me.handle(far[1].public_key, "dht.ping", {"from": ["sim:b"]})
        net.dead.add(far[0].public_key)
        autojump_clock.jump(61)  # the entries were heard from over a minute ago
        await me.handle(far[2].public_key, "dht.ping", {"from": ["sim:c"]})
        await trio.testing.wait_all_tasks_blocked()
        assert far[2].contact not in me.table  # waits while the oldest is checked
        autojump_clock.jump(1)  # past the check's 0.1 s timeout
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert far[0].contact not in me.table and far[1].contact in me.table


async def test_find_peer_reports_the_addresses_a_moved_peer_announced(small):
    net, nodes = small
    seeker, mover = nodes[11], nodes[12]
    seeker.table.update(mover.own_contact())  # the seeker knows the old address
    mover._addrs = lambda: ["sim:new-address"]
    async with trio.open_nursery() as nursery:
        for node in nodes:
            node.start(nursery)
        await mover.find_node(mover.id)  # its neighbours hear from it at the new address
        seeker.table.update(Contact(mover.public_key, ("sim:12",)))  # the seeker still has the old one
        found = await seeker.find_peer(mover.public_key)
        assert await seeker.find_peer(bytes(32)) is None
        nursery.cancel_scope.cancel()
    assert found.addrs == ("sim:new-address", "sim:12")  # the old address last


async def test_a_get_that_found_nothing_among_the_nearest_asks_the_rest_of_the_k_nearest(autojump_clock):
    """A writer that does not know a key's nearest nodes stores at the nearest it knows
    (a small mesh with partial tables); a reader's lookup ends once the beta nearest
    answered, so it found nothing while others held the record (1 get in 150 in a run
    of benchmarks/dht.py)."""
    async with small_mesh(9) as (net, nodes):
        key = b"/open/beyond-the-nearest"
        reader = nodes[0]
        ranked = true_closest(nodes, key_id(key), 12)
        holder = net.nodes[next(pk for pk in reversed(ranked) if pk != reader.public_key)]
        record = await _signed(holder, key, b"v", seq=1)
        holder.records.put(record, holder.wall())  # only the farthest of the 12 holds it
        assert (await reader.get(key)).value == b"v"
        assert (await reader.get(b"/open/held-nowhere")) is None  # and a miss still ends


async def test_a_get_that_found_nothing_waits_for_its_overdue_queries(autojump_clock):
    """Replicas that answer late (a loaded machine) are overdue, and the lookup goes on
    without them; but a get that found no record yet waits for them before saying
    there is none (found by a 20-daemon test under a full suite's load)."""
    net = SimNetwork(latency=0.005)
    nodes = make_nodes(net, 40, seed=8)
    fill_tables(nodes, seed=8)
    async with trio.open_nursery() as nursery:
        for node in nodes:
            node.start(nursery)
        await nodes[0].put(b"/open/late", b"v")
        await net.settle()
        holders = {n.public_key for n in nodes if n.records.get(b"/open/late", n.wall()) is not None}
        getter = next(n for n in nodes if n.public_key not in holders)
        await getter.find_node(getter.id)  # it learns how long an answer takes (10 ms)
        net.slow.update(dict.fromkeys(holders, 0.5))  # well past overdue, well within the timeout
        record = await getter.get(b"/open/late")
        nursery.cancel_scope.cancel()
    assert record is not None and record.value == b"v"


async def test_a_node_that_failed_a_query_is_left_out_of_later_lookups(small):
    net, nodes = small
    target = key_id(b"near a dead node")
    seeker = nodes[30]
    [dead_key] = true_closest(nodes, target, 1, seeker)
    net.dead.add(dead_key)
    try:
        async with trio.open_nursery() as nursery:
            for node in nodes:
                node.start(nursery)
            await seeker.find_node(target)
            assert net.calls[dead_key] == 1  # tried once, overdue
            for node in nodes:  # the others still name it in their answers
                if node is not seeker and node.public_key != dead_key:
                    node.table.update(net.nodes[dead_key].own_contact())
            found = await seeker.find_node(target)
            nursery.cancel_scope.cancel()
    finally:
        net.dead.clear()
    assert net.calls[dead_key] == 1  # not asked again
    assert dead_key not in {c.public_key for c in found}


async def test_a_node_that_failed_is_asked_again_once_it_talks_to_us(small):
    """A node that was down and is back (a daemon SIGKILLed and restarted) is asked
    again as soon as it sends us a request itself: hearing from it directly is proof
    it lives, unlike third parties naming it (found by the chaos soak, docs/soak.md)."""
    net, nodes = small
    target = key_id(b"near a restarted node")
    seeker = nodes[30]
    [back_key] = true_closest(nodes, target, 1, seeker)
    back = net.nodes[back_key]
    net.dead.add(back_key)
    try:
        async with trio.open_nursery() as nursery:
            for node in nodes:
                node.start(nursery)
            await seeker.find_node(target)
            assert not seeker._usable(back.own_contact())  # overdue: left out from now on
            net.dead.discard(back_key)
            await back.bootstrap([seeker.own_contact()])  # it is back, and asks the seeker
            assert seeker._usable(back.own_contact())
            found = await seeker.find_node(target)
            nursery.cancel_scope.cancel()
    finally:
        net.dead.clear()
    assert found[0].public_key == back_key
