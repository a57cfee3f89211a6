"""The limits that bound what peers can make a node do are config keys: read from
TOML, refused by name when out of bounds, defaulted to the old constants, and
threaded to where they bind (docs/security.md)."""

import math
import os
import time

import msgpack
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fakehost import FakeHost, FakeProviders, FakeRecords
from memstream import memory_call_stream_pair

from crdt.change import MAX_CHANGE, MAX_OPS, ChangeError, decode_change
from crdt.document import Document
from dht.ids import Contact
from dht.messages import MAX_BULK
from dht.network import FIND_NODE, PUT_VALUE, Refused
from dht.node import DhtConfig
from dht.records import sign_record
from dht.simnet import SimNetwork, make_nodes
from meshd.config import CONFIG_FILE, ConfigError
from meshd.daemon import Config
from meshd.identity import Identity
from meshd.lane import MAX_CHUNK, MAX_IDS, _parse_request
from meshd.rpc import DeadlineExceeded, InvalidArgument, RpcServer, unary_call
from meshd.rpc.peer import PeerRpc
from meshd.services.crdt import Crdt
from meshd.services.nat import Nat
from meshd.services.shards import Shards
from meshd.transport import Endpoint
from meshd.transport.stream import CONNECTION_SEND_HIGH_WATER, SEND_HIGH_WATER
from nat.autonat import REQUEST_INTERVAL

# every key this test file covers: section, key, its default (the old constant where there was one), another good value
KEYS = [
    ("transport", "max_streams", 32, 16),
    ("transport", "send_high_water", SEND_HIGH_WATER, 1 << 20),
    ("transport", "connection_send_high_water", CONNECTION_SEND_HIGH_WATER, 1 << 20),
    ("transport", "recv_batch", 16, 64),
    ("transport", "socket_buffer", 8 << 20, 1 << 20),
    ("transport", "recv_queue", 16 << 20, 1 << 20),
    ("rpc", "first_frame_timeout", 10.0, 2.5),
    ("rpc", "max_call_timeout", 3600.0, 60.0),
    ("rpc", "busy_calls", 32, 8),
    ("rpc", "peer_share", 16, 2),
    ("rpc", "peer_held_bytes", 32 << 20, 8 << 20),
    ("rpc", "held_bytes", 256 << 20, 64 << 20),
    ("rpc", "address_held_bytes", 64 << 20, 16 << 20),
    ("dht", "peer_rate", 20.0, 5.0),
    ("dht", "peer_burst", 200, 50),
    ("dht", "max_per_prefix", 3, 1),
    ("dht", "ipv4_prefix", 24, 16),
    ("dht", "ipv6_prefix", 48, 56),
    ("dht", "check_after", 60.0, 30.0),
    ("dht", "max_records", 65536, 1000),
    ("dht", "max_record_bytes", 64 << 20, 1 << 20),
    ("dht", "max_records_per_author", 1024, 10),
    ("dht", "max_providers_per_key", 64, 8),
    ("dht", "max_provider_keys", 65536, 100),
    ("dht", "max_providers", 262144, 1000),
    ("dht", "max_request_items", MAX_BULK, 8),
    ("crdt", "max_change", MAX_CHANGE, 64 << 10),
    ("crdt", "max_ops", MAX_OPS, 100),
    ("nat", "autonat_interval", REQUEST_INTERVAL, 30.0),
    ("shards", "lane_max_chunk", MAX_CHUNK, 1 << 20),
    ("shards", "lane_max_ids", MAX_IDS, 64),
]

BAD = [
    ("transport", "max_streams", 0),
    ("transport", "send_high_water", 100),
    ("transport", "connection_send_high_water", 100),
    ("transport", "recv_batch", 0),
    ("transport", "socket_buffer", -1),
    ("transport", "recv_queue", 1000),
    ("rpc", "first_frame_timeout", 0.0),
    ("rpc", "max_call_timeout", -1.0),
    ("rpc", "max_call_timeout", math.nan),
    ("rpc", "busy_calls", 0),
    ("rpc", "peer_share", 0),
    ("rpc", "peer_held_bytes", 1000),
    ("rpc", "held_bytes", 0),
    ("dht", "peer_rate", 0.0),
    ("dht", "peer_burst", 0),
    ("dht", "max_per_prefix", 0),
    ("dht", "ipv4_prefix", 33),
    ("dht", "ipv6_prefix", 0),
    ("dht", "check_after", -1.0),
    ("dht", "max_records", 0),
    ("dht", "max_record_bytes", 10),
    ("dht", "max_records_per_author", 0),
    ("dht", "max_providers_per_key", 0),
    ("dht", "max_provider_keys", 0),
    ("dht", "max_providers", 0),
    ("dht", "max_request_items", 1000),
    ("crdt", "max_change", 100),
    ("crdt", "max_ops", 0),
    ("nat", "autonat_interval", 0.0),
    ("shards", "lane_max_chunk", 1 << 30),
    ("shards", "lane_max_ids", 0),
]


def loaded(tmp_path, text: str) -> Config:
    (tmp_path / CONFIG_FILE).write_text(text)
    return Config.load(tmp_path)


def toml(value) -> str:
    return repr(value) if not isinstance(value, float) or math.isfinite(value) else "nan"


@pytest.mark.parametrize("section,key,default,other", KEYS, ids=[f"{s}.{k}" for s, k, *_ in KEYS])
def test_each_limit_defaults_to_the_old_constant_and_is_read_from_toml(tmp_path, section, key, default, other):
    assert getattr(getattr(Config(), section), key) == default
    config = loaded(tmp_path, f"[{section}]\n{key} = {toml(other)}\n")
    assert getattr(getattr(config, section), key) == other


@pytest.mark.parametrize("section,key,bad", BAD, ids=[f"{s}.{k}={v}" for s, k, v in BAD])
def test_a_limit_out_of_bounds_is_refused_naming_the_key(tmp_path, section, key, bad):
    with pytest.raises(ConfigError, match=rf"{CONFIG_FILE}: {section}\.{key} must be"):
        loaded(tmp_path, f"[{section}]\n{key} = {toml(bad)}\n")
    with pytest.raises(ConfigError, match=rf"{section}\.{key} must be"):
        Config().update({section: {key: bad}})


def test_the_dht_section_gives_the_library_its_own_defaults():
    assert Config().dht.dht_config() == DhtConfig()


# --- the values reach what they bound -------------------------------------------------


def dht_node(**keys):
    config = Config()
    config.update({"dht": keys})
    [node] = make_nodes(SimNetwork(), 1, config=config.dht.dht_config(), seed=7)
    return node


class Author:
    def __init__(self):
        self._key = Ed25519PrivateKey.generate()
        self.public_key = self._key.public_key().public_bytes_raw()

    def record(self, key: bytes):
        return sign_record(key, b"v", public_key=self.public_key, sign=self._key.sign, seq=1,
                           expires=int(time.time()) + 3600).to_wire()


@pytest.mark.parametrize("per_author,refused", [(None, 0), (2, 1)])
async def test_dht_records_per_author_bind_at_the_configured_value(per_author, refused):
    node = dht_node(**({} if per_author is None else {"max_records_per_author": per_author}))
    author = Author()
    reply = await node.handle(author.public_key, PUT_VALUE,
                              {"records": [author.record(b"/open/%d" % i) for i in range(3)]})
    errors = [e for e in reply["stored"] if e is not None]
    assert len(errors) == refused
    assert all("too many records" in e and "limit 2" in e for e in errors)


async def test_dht_items_per_request_bind_at_the_configured_value():
    ids = {"ids": [os.urandom(32) for _ in range(3)]}
    assert len((await dht_node().handle(Author().public_key, FIND_NODE, ids))["nodes"]) == 3
    with pytest.raises(Refused, match="1 to 2 items"):
        await dht_node(max_request_items=2).handle(Author().public_key, FIND_NODE, ids)


def in_far_bucket(table, addr: str) -> Contact:
    while True:  # half of all keys fall in the farthest bucket
        contact = Contact(os.urandom(32), (addr,))
        if table.bucket_of(contact) == 255:
            return contact


@pytest.mark.parametrize("keys,admitted,third", [
    ({}, 2, True),  # two /24s; a second in one of them is within 3 per /24
    ({"max_per_prefix": 1}, 2, False),
    ({"ipv4_prefix": 16}, 2, True),  # one /16 of three: within 3
    ({"ipv4_prefix": 16, "max_per_prefix": 2}, 2, False),
    ({"ipv4_prefix": 16, "max_per_prefix": 1}, 1, False),
])
def test_dht_prefix_limit_and_size_bind_at_the_configured_values(keys, admitted, third):
    table = dht_node(**keys).table
    same_16 = [in_far_bucket(table, "203.0.1.5:4100"), in_far_bucket(table, "203.0.2.5:4100")]
    for contact in same_16:
        table.update(contact)
    assert sum(c in table for c in same_16) == admitted
    same_24 = in_far_bucket(table, "203.0.1.6:4100")  # the first one's /24
    table.update(same_24)
    assert (same_24 in table) == third


def three_op_change(owner: bytes, sign) -> object:
    doc = Document(owner, "notes")
    tx = doc.transaction()
    for key in "abc":
        tx.set([key], 1)
    return doc.prepare(tx, owner, sign, int(time.time() * 1000))


def test_crdt_limits_bind_where_changes_are_made_and_decoded():
    key = Ed25519PrivateKey.generate()
    owner = key.public_key().public_bytes_raw()
    change = three_op_change(owner, key.sign)  # the defaults take it
    assert decode_change(change.wire).id == change.id
    with pytest.raises(ChangeError, match="1 to 2 operations"):
        decode_change(change.wire, max_ops=2)
    with pytest.raises(ChangeError, match=f"at most {len(change.wire) - 1} bytes"):
        decode_change(change.wire, max_change=len(change.wire) - 1)
    small = Document(owner, "notes", max_ops=2)
    tx = small.transaction()
    for k in "abc":
        tx.set([k], 1)
    with pytest.raises(ChangeError, match="1 to 2 operations"):
        small.prepare(tx, owner, key.sign, 0)


@pytest.mark.parametrize("max_ops", [None, 2])
async def test_the_crdt_service_refuses_a_peers_change_over_its_max_ops(tmp_path, max_ops):
    host = FakeHost(tmp_path)
    config = Config()
    if max_ops is not None:
        config.update({"crdt": {"max_ops": max_ops}})
    service = Crdt(host, config.crdt, providers=FakeProviders(host.peer_id))
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            control = service.control_methods()
            await control["crdt.open"]({"doc": "notes", "create": True}, None)
            change = three_op_change(host.peer_id.key, host.identity.sign)

            class Ctx:
                peer = host.peer_id
                info: dict = {}

            push = service.rpc_methods()["crdt.push"]
            pushed = {"doc": change.doc, "changes": [change.wire]}
            three_ops = {"doc": "notes", "ops": [["set", [k], 1] for k in "abc"]}
            if max_ops is None:
                assert (await push(pushed, Ctx()))["new"] == 1
                await control["crdt.write"](three_ops, None)
            else:
                with pytest.raises(InvalidArgument, match="1 to 2 operations"):
                    await push(pushed, Ctx())
                with pytest.raises(InvalidArgument, match="1 to 2 operations"):
                    await control["crdt.write"](three_ops, None)
            nursery.cancel_scope.cancel()
    finally:
        service.close()


def test_transport_max_streams_reaches_each_quic_connection(tmp_path):
    config = loaded(tmp_path, "[transport]\nmax_streams = 5\n")
    endpoint = Endpoint(Identity.generate(), config.transport, on_connection=print, on_connection_lost=print)
    quic = endpoint._new_quic(True, ("127.0.0.1", 4100))
    assert quic._local_max_streams_bidi.value == 5 and quic._local_max_streams_uni.value == 5
    default = Endpoint(Identity.generate(), Config().transport, on_connection=print, on_connection_lost=print)
    assert default._new_quic(True, ("127.0.0.1", 4100))._local_max_streams_bidi.value == 32


def test_transport_recv_queue_bounds_the_endpoints_inbox(tmp_path):
    config = loaded(tmp_path, "[transport]\nrecv_queue = 1048576\n")
    endpoint = Endpoint(Identity.generate(), config.transport, on_connection=print, on_connection_lost=print)
    assert endpoint._inbox.max_bytes == 1 << 20


def served_by(rpc_keys: dict) -> RpcServer:
    config = Config()
    config.update({"rpc": rpc_keys})
    return PeerRpc(lambda peer: None, config.rpc).server


def test_the_fairness_keys_reach_the_peer_rpc_server():
    turns = served_by({"busy_calls": 8, "peer_share": 2})._turns
    assert (turns.busy, turns.share) == (8, 2)


def test_the_byte_budget_keys_reach_the_peer_rpc_server():
    budget = served_by({"peer_held_bytes": 8 << 20, "held_bytes": 64 << 20, "address_held_bytes": 16 << 20}).budget
    assert (budget.share, budget.total, budget.address_share) == (8 << 20, 64 << 20, 16 << 20)


@pytest.mark.parametrize("keys,waited", [({}, 10.0), ({"first_frame_timeout": 2.0}, 2.0)])
async def test_a_stream_without_a_request_ends_after_the_configured_first_frame_timeout(
        autojump_clock, keys, waited):
    server = served_by(keys)
    client, stream = memory_call_stream_pair()
    start = trio.current_time()
    await server.serve_call(stream, "peer-1")
    assert trio.current_time() - start == pytest.approx(waited)


@pytest.mark.parametrize("keys,waited", [({}, 3600.0), ({"max_call_timeout": 5.0}, 5.0)])
async def test_a_call_runs_at_most_the_configured_max_call_timeout(autojump_clock, nursery, keys, waited):
    server = served_by(keys)

    async def sleep_forever(arg, ctx):
        await trio.sleep_forever()

    server.register("sleep", sleep_forever)

    async def open_():
        client, stream = memory_call_stream_pair()
        nursery.start_soon(server.serve_call, stream, "peer-1")
        return client

    start = trio.current_time()
    with pytest.raises(DeadlineExceeded):
        await unary_call(open_, "sleep", None, 86400.0, 1 << 20)
    assert trio.current_time() - start == pytest.approx(waited, abs=0.1)


def test_the_autonat_interval_reaches_the_per_peer_limit(tmp_path):
    host = FakeHost(tmp_path)
    config = Config()
    assert Nat(host, config.nat, config.relay).autonat._requests.interval == REQUEST_INTERVAL
    config.update({"nat": {"autonat_interval": 2.5}})
    assert Nat(host, config.nat, config.relay).autonat._requests.interval == 2.5


async def test_the_lane_limits_reach_the_shards_lane(tmp_path):
    host = FakeHost(tmp_path)
    config = Config()
    config.update({"shards": {"lane_max_chunk": 1 << 20, "lane_max_ids": 2}})
    providers = FakeProviders(host.peer_id)
    crdt = Crdt(host, config.crdt, providers=providers)
    shards = Shards(host, config.shards, providers=providers, records=FakeRecords(host.identity), documents=crdt)
    try:
        assert (shards._lane.max_chunk, shards._lane.max_ids) == (1 << 20, 2)
    finally:
        shards.close()
        crdt.close()
    ids = msgpack.packb([os.urandom(32) for _ in range(3)])
    assert len(_parse_request(ids)) == 3
    with pytest.raises(ValueError):
        _parse_request(ids, 2)
