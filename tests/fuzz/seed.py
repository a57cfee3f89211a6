"""Write the seed corpus: ``python tests/fuzz/seed.py`` fills ``tests/fuzz/corpus/<target>/``.

Seeds are valid encodings made by the project's own encoders (signed with
:data:`harness.PUBLIC`'s key, fresh at :data:`harness.NOW`) plus a few edge
cases each.  A file is named by the first 16 hex digits of its SHA-1, as
libFuzzer names what it adds, so running this again adds nothing twice and
leaves what the fuzzer found in place.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Callable, Iterable

import torch

import harness
from crdt.document import Document
from crdt.reconcile import ItemSet, Reconciler
from dht.names import name_key, name_value, sign_claim
from dht.network import METHODS
from dht.records import owned_key, sign_record
from learn.compress import encode as encode_tensor
from learn.wire import Contribution, digest_of, frames as tensor_frames, header
from meshd.identity import PeerId
from meshd.lane import _Framer
from meshd.rpc.protocol import END_FRAME, ERROR, ITEM, REPLY, SERVER_STREAM, UNARY, request_frame
from meshd.services.experts.tensors import to_wire as expert_to_wire
from meshd.transport.connection import REPLACED_REASON
from meshd.services.shards.format import encode_tensors, sign_manifest
from meshd.services.shards.names import Version, encode_versions
from meshd.wire import pack
from nat import natpmp, stun
from targets import TARGETS

CORPUS = Path(__file__).parent / "corpus"
PEER = str(PeerId(harness.PUBLIC))
EXPIRES = harness.NOW + 3600


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=generator), "b": torch.arange(7, dtype=torch.int32),
            "c": torch.zeros(0, 2), "d": torch.tensor([True, False])}


def _stun() -> list[bytes]:
    request = stun.binding_request(bytes(12))
    return [request.encode(), request.encode(fingerprint=False),
            stun.binding_success(request, ("203.0.113.7", 4242)).encode(),
            stun.binding_success(request, ("2001:db8::1", 4242)).encode(integrity_key=b"key"),
            stun.error_response(request, 420, "Unknown Attribute", [0x7777]).encode(),
            stun.StunMessage(stun.BINDING, stun.StunClass.REQUEST, bytes(12),
                             ((stun.SOFTWARE, b"meshd"), (stun.USERNAME, b"user"), (0x7777, b"x"))).encode()]


def _natpmp() -> list[bytes]:
    mapping = natpmp.Mapping(4242, 4243, 7200)
    return [natpmp.external_address_request(), natpmp.map_udp_request(4242, 4242, 7200),
            natpmp.external_address_response(9, "198.51.100.1"), natpmp.map_udp_response(9, mapping),
            natpmp.map_udp_response(9, mapping, natpmp.REFUSED)]


def _beacon() -> list[bytes]:
    from nat.beacon import encode_beacon  # noqa: PLC0415  (a module that may not exist yet)

    return [encode_beacon(harness.PUBLIC, 4242, harness.NOW, harness.sign)]


def _rpc() -> list[bytes]:
    return [harness.framed(request_frame("dht.ping", 5.0, UNARY, {}), [REPLY, {"ok": True}]),
            harness.framed(request_frame("shards.list", None, SERVER_STREAM, None), [ITEM, [1, 2]], END_FRAME),
            harness.framed(request_frame("x", 0, UNARY, b""), [ERROR, "NOT_FOUND", "no such thing"])]


def _wire() -> list[bytes]:
    return [*_rpc(), harness.framed({"k": b"v", "n": [1, 2.5, None, True]}), b"\x00\x00\x00\x01\xc0",
            b"\xff\xff\xff\xff"]


def _lane() -> list[bytes]:
    stream = harness.MemoryStream()
    sender = _Framer(stream, harness.LANE_KEY, 1 << 20)
    for ids in ([bytes(32)], [bytes([n]) * 32 for n in range(5)]):
        harness.drive(sender.send(pack(ids)))
    return [bytes(stream.sent)]


def _lane_request() -> list[bytes]:
    return [pack([bytes(32)]), pack([bytes([n]) * 32 for n in range(256)]), pack([])]


def _record(key: bytes, value: bytes) -> dict:
    return sign_record(key, value, public_key=harness.PUBLIC, sign=harness.sign, seq=1,
                       expires=EXPIRES).to_wire()


def _name_value() -> bytes:
    claim = sign_claim(name_key("model"), owner=harness.PUBLIC, sign=harness.sign, seq=1,
                       writers=(bytes(32),))
    return name_value(claim, _versions()[0])


def _records() -> list[dict]:
    return [_record(b"/open/key", b"value"), _record(owned_key(harness.PUBLIC, b"mine"), b""),
            _record(name_key("model"), _name_value())]


def _dht_request() -> list[bytes]:
    contact = {"pk": harness.PUBLIC, "a": ["198.51.100.1:4242"]}
    messages = {"dht.ping": {"from": contact["a"]}, "dht.find_node": {"ids": [bytes(32)]},
                "dht.get_value": {"keys": [b"/open/key"]}, "dht.put_value": {"records": _records()},
                "dht.add_provider": {"keys": [b"k"], "a": ["[2001:db8::1]:1"], "ttl": 60},
                "dht.get_providers": {"keys": [b"k", b"l"], "from": ["10.0.0.1:1"]}}
    return [bytes([METHODS.index(method)]) + pack(msg) for method, msg in messages.items()]


def _dht_reply() -> list[bytes]:
    contact = {"pk": harness.PUBLIC, "a": ["198.51.100.1:4242"]}
    return [pack({"nodes": [[contact]], "server": True}),
            pack({"records": [_records()[2]], "nodes": [[contact]]}),
            pack({"providers": [[{**contact, "exp": EXPIRES}]], "nodes": [[]]}),
            pack({"stored": [None, "refused"]})]


def _versions() -> list[bytes]:
    return [encode_versions({1: Version(bytes(32), 1024, harness.NOW, harness.PUBLIC),
                             2: Version(bytes([1]) * 32, 2048, harness.NOW + 1, bytes(32))})]


def _changes() -> list[bytes]:
    """Changes on the document the batch target holds: the owner sets, counts, adds,
    grants, then revokes and deletes on top."""
    document = Document(harness.PUBLIC, harness.DOC_NAME)
    wires = []
    for build in (lambda tx: (tx.set(["title"], "fuzz"), tx.inc(["n"], 3), tx.add(["tags"], b"x")),
                  lambda tx: (tx.grant(bytes(32)), tx.assign(["m"], {"k": [1.5, None]})),
                  lambda tx: (tx.revoke(bytes(32)), tx.delete(["title"]), tx.remove(["tags"], b"x"))):
        tx = document.transaction()
        build(tx)
        change = document.prepare(tx, harness.PUBLIC, harness.sign, time_ms=harness.NOW * 1000)
        document.receive(change)
        wires.append(change.wire)
    return wires


def _reconcile() -> list[bytes]:
    """What a peer holding other keys sends, message by message, to the target's side."""
    seeds = []
    for numbers in (range(0, 300, 2), range(0, 300, 3), range(290, 400)):
        peer, ours = Reconciler(ItemSet(harness.sync_keys(numbers))), \
            Reconciler(ItemSet(harness.sync_keys(range(0, 300, 3))))
        sent, message = [], peer.initiate()
        while message is not None:
            sent.append(message)
            reply = ours.receive(message)
            message = None if reply is None else peer.receive(reply)
        seeds.append(harness.framed(*sent))
    return seeds


def _manifest() -> list[bytes]:
    layout, _ = encode_tensors(_tensors(), chunk_size=64)
    return [sign_manifest(layout, "model", 1, sign=harness.sign, public_key=harness.PUBLIC,
                          created=harness.NOW).encode()]


def _safetensors_header() -> list[bytes]:
    return [b'{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},'
            b'"b":{"dtype":"BF16","shape":[],"data_offsets":[16,18]}}    ', b"{}", b'{"a":1e400}']


def _relay() -> list[bytes]:
    return [pack({"ttl": 3600, "max_circuits": 4, "circuit_bytes": 1 << 20, "circuit_seconds": 120.0}),
            pack({"peer": PEER}), pack({"ttl": 0, "max_circuits": -1})]


def _punch() -> list[bytes]:
    return [pack({"addrs": ["203.0.113.7:4242", "[2001:db8::1]:4242"], "mapping": "endpoint-independent"}),
            pack({"addrs": ["host:0", "x:65536", "1.2.3.4:"]})]


def _autonat() -> list[bytes]:
    return [pack({"exclude": [PEER]}), pack({"peer": PEER, "addr": "203.0.113.7:4242"}),
            pack({"reachable": True, "address": "203.0.113.7:4242", "via": PEER})]


def _tensor_set(codec: str, lent: bool) -> bytes:
    named = [(name, encode_tensor(t, codec if t.is_floating_point() else "none", block=64))
             for name, t in sorted(_tensors().items())]
    contribution = Contribution("group", 3, harness.PUBLIC, "params", 100, digest_of(named))
    head = {"contribution": contribution.to_wire(), "signature": contribution.sign(harness.sign)}
    if lent:
        return harness.framed({**head, "lane": bytes(32), "tensors": len(named)},
                              *(header(name, enc) for name, enc in named))
    return harness.framed(head, *tensor_frames(named))


def _learn_tensor_set() -> list[bytes]:
    return [_tensor_set(codec, lent) for codec in ("none", "fp16", "bf16", "int8", "int4")
            for lent in (False, True) if codec == "none" or not lent]


def _learn_codec() -> list[bytes]:
    tensor = torch.linspace(-1, 1, 130)
    seeds = []
    for codec in ("none", "fp16", "bf16", "int8", "int4"):
        enc = encode_tensor(tensor, codec, block=64)
        seeds.append(pack([enc.codec, enc.dtype, list(enc.shape), enc.block, bytes(enc.payload)]))
    return seeds


def _expert_tensors() -> list[bytes]:
    return [pack({"inputs": expert_to_wire(list(_tensors().values()))}),
            pack({"inputs": [{"dtype": "bool", "shape": [1], "data": b"\x02"}]})]


SEEDS: dict[str, Callable[[], Iterable[bytes]]] = {
    "stun": _stun, "stun_server": _stun, "natpmp_messages": _natpmp, "beacon": _beacon,
    "wire_frames": _wire, "rpc_frames": _rpc, "lane_frames": _lane, "lane_request": _lane_request,
    "dht_request": _dht_request, "dht_reply": _dht_reply, "dht_record": lambda: map(pack, _records()),
    "dht_name_value": lambda: [_name_value()], "shard_versions": _versions,
    "dht_relays": lambda: [pack([f"{PEER}@203.0.113.7:4100", f"{PEER}@[2001:db8::1]:4100"]), pack([])],
    "crdt_change": _changes, "crdt_batch": lambda: [pack(_changes())], "crdt_reconcile": _reconcile,
    "shard_manifest": _manifest, "safetensors_header": _safetensors_header, "relay": _relay,
    "punch": _punch, "autonat": _autonat, "learn_tensor_set": _learn_tensor_set,
    "learn_codec": _learn_codec, "expert_tensors": _expert_tensors,
    "replaced_reason": lambda: [f"{REPLACED_REASON} (last stream 4)".encode(),
                                f"{REPLACED_REASON} (unseen 0 8) (last stream 12)".encode(),
                                f"{REPLACED_REASON} (last stream -1)".encode()],
}


def write(name: str, data: bytes, folder: Path = CORPUS) -> Path:
    """Save ``data`` as ``folder/name/<sha1 prefix>``; the path (unchanged if already there)."""
    path = folder / name / hashlib.sha1(data).hexdigest()[:16]
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_bytes(data)
    return path


def main() -> None:
    """Seed every target of ``targets.TARGETS``; a target with no seeds is an error."""
    missing = sorted(set(TARGETS) - set(SEEDS))
    if missing:
        sys.exit(f"no seeds for: {', '.join(missing)}")
    for name in TARGETS:
        for data in SEEDS[name]():
            write(name, data)
            TARGETS[name](data)  # a seed must run clean
    print(f"seeded {len(TARGETS)} targets in {CORPUS}")


if __name__ == "__main__":
    main()
