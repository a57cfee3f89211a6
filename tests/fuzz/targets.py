"""One fuzz target per decoder of peer data: ``target(data: bytes) -> None``.

Each target hands ``data`` to its decoder the way the network does (a frame
stream through :class:`meshd.wire.FrameDecoder`, a msgpack value through
:func:`meshd.wire.unpack` with the frame limits, or raw bytes where the
decoder reads a datagram or a stream itself) and lets through only the
errors that decoder documents for malformed input: its refusal.  Anything
else it raises, or a hang, is a finding.  ``TARGETS`` maps each name to its
function; a target's ``allowed`` attribute is the tuple of refusals.

Signatures: a target never needs a forged signature to reach a check.  Where
a decoder verifies one only at its end, the target lets it do so (seeds are
signed with :data:`harness.PUBLIC`'s key); where the network verifies before
applying (CRDT batches, learning contributions), the target applies without
verifying, as a peer that signs whatever it likes would get applied.
"""

from __future__ import annotations

import functools
from contextlib import suppress
from typing import Callable

import msgpack

import harness
from crdt.change import ChangeError, decode_change
from crdt.document import Document, Rejected
from crdt.reconcile import ItemSet, Reconciler, ReconcileError
from dht import messages as m
from dht.ids import node_id
from dht.network import METHODS, Refused
from dht.names import parse_name_value
from dht.ratelimit import RateLimiter
from dht.records import Record, RecordError
from dht.routing import RoutingTable
from dht.server import DhtServer
from dht.storage import ProviderStore, RecordStore
from dht.validators import Validators
from learn.compress import decode as decode_tensor
from learn.encoded import CodecError, Encoded
from learn.wire import Contribution, Decoder, Limits, WireError, chunk_counts, digest_of
from meshd.address import AddressError, HostPort
from meshd.lane import _MAX_REQUEST, LaneError, _Framer, _parse_request
from meshd.rpc.args import field, peer_field, to_peer
from meshd.rpc.errors import InvalidArgument, ProtocolViolation
from meshd.rpc.protocol import parse_frame, parse_request
from meshd.services.dht.relays import decode_relays
from meshd.services.experts.config import ExpertsSection
from meshd.services.experts.tensors import from_wire as expert_tensors_from_wire
from meshd.services.shards.format import ManifestError, decode_manifest, parse_header
from meshd.services.shards.names import decode_versions
from meshd.transport.connection import unseen_by_peer
from meshd.wire import FrameDecoder, FrameError, unpack
from nat import natpmp
from nat.autonat import Verdict, parse_dial_back, parse_exclude, reachable_of
from nat.errors import Malformed
from nat.punch import mapping_of, parse_addresses
from nat.relay import parse_limits
from nat.stun import ALTERNATE_SERVER, OTHER_ADDRESS, RESPONSE_ORIGIN, StunError
from nat.stun import decode as decode_stun
from nat.stun_server import answer as stun_answer

TARGETS: dict[str, Callable[[bytes], None]] = {}


def target(*allowed: type[BaseException]):
    """Register the decorated function as the target of its name, letting the
    ``allowed`` refusals through and nothing else."""

    def register(run: Callable[[bytes], None]) -> Callable[[bytes], None]:
        @functools.wraps(run)
        def fuzz(data: bytes) -> None:
            with suppress(*allowed):
                run(data)

        fuzz.allowed = allowed
        TARGETS[run.__name__] = fuzz
        return fuzz

    return register


# --- datagrams: STUN, NAT-PMP, LAN beacons ------------------------------------------------


@target(StunError)
def stun(data: bytes) -> None:
    """A STUN datagram through ``nat.stun.decode``, then every attribute it interprets."""
    message = decode_stun(data)
    for name in ("xor_mapped_address", "mapped_address", "error_code", "unknown_attributes", "software",
                 "username"):
        getattr(message, name)
    for attr_type in (RESPONSE_ORIGIN, OTHER_ADDRESS, ALTERNATE_SERVER):
        message.address(attr_type)


@target()
def stun_server(data: bytes) -> None:
    """A datagram to a node's STUN server: an answer (which must itself decode) or none."""
    reply = stun_answer(data, ("192.0.2.1", 4242))
    if reply is not None:
        decode_stun(reply, comprehended=range(0x8000))


@target()
def natpmp_messages(data: bytes) -> None:
    """A NAT-PMP request (as a gateway gets it) and both answers (as a client gets them)."""
    for parse in (natpmp.parse_request, natpmp.parse_external_address, natpmp.parse_map_udp):
        with suppress(natpmp.NatPmpError):
            parse(data)


try:  # the LAN beacons of nat/beacon.py, where that module exists
    from nat.beacon import decode_beacon

    @target(Malformed)
    def beacon(data: bytes) -> None:
        """A LAN discovery datagram through ``nat.beacon.decode_beacon`` at ``harness.NOW``."""
        decode_beacon(data, harness.NOW)
except ImportError:
    pass


# --- frames: RPC, the bulk lane -----------------------------------------------------------


@target(FrameError)
def wire_frames(data: bytes) -> None:
    """A stream of frames, whole and in 7-byte pieces: both must give the same values."""
    whole = list(harness.frames(data))
    decoder, pieces = FrameDecoder(), []
    for at in range(0, len(data), 7):
        decoder.feed(data[at:at + 7])
        while (frame := decoder.next_frame())[0]:
            pieces.append(frame[1])
    assert pieces == whole, "frames decode differently when the stream arrives in pieces"


@target(FrameError, ProtocolViolation)
def rpc_frames(data: bytes) -> None:
    """A call's stream as a server reads it: a REQUEST, then REPLY/ITEM/END/ERROR frames."""
    stream = harness.frames(data)
    for frame in stream:
        parse_request(frame)
        break
    for frame in stream:
        parse_frame(frame)


@target(LaneError)
def lane_frames(data: bytes) -> None:
    """A lane's TCP bytes after the hello, as the server opens them (key ``harness.LANE_KEY``)."""
    rx = _Framer(harness.MemoryStream(data), harness.LANE_KEY, _MAX_REQUEST)
    while (payload := harness.drive(rx.receive())) is not None:
        with suppress(ValueError, msgpack.UnpackException):
            _parse_request(payload)


@target(ValueError, msgpack.UnpackException)
def lane_request(data: bytes) -> None:
    """An opened lane frame from an authenticated client: a request for chunk ids."""
    _parse_request(data)


@target()
def replaced_reason(data: bytes) -> None:
    """The reason phrase of a peer's close as replaced (aioquic hands it over as text),
    through ``unseen_by_peer``: an answer for any text."""
    unseen_by_peer(data.decode("utf-8", errors="replace"))


# --- the DHT ------------------------------------------------------------------------------


def _dht_server() -> DhtServer:
    """A server over empty in-memory stores, as a fresh node has (a new one per input)."""
    own = bytes(32)
    table = RoutingTable(node_id(own))
    return DhtServer(
        table=table, records=RecordStore(None, node_id(own), Validators.default(), now=harness.NOW),
        providers=ProviderStore(None, now=harness.NOW), put_limiter=RateLimiter(10, 20),
        provider_limiter=RateLimiter(10, 20), k=20, provider_ttl=3600, wall=lambda: harness.NOW,
        clock=lambda: 0.0, heard_from=table.update, is_server=lambda: True)


@target(FrameError, Refused)
def dht_request(data: bytes) -> None:
    """A DHT request: the first byte picks the method (of ``dht.network.METHODS``), the
    rest is its msgpack argument, answered by ``DhtServer.handle``."""
    if data:
        method = METHODS[data[0] % len(METHODS)]
        harness.drive(_dht_server().handle(harness.PUBLIC, method, unpack(data[1:])))


def _reply_nodes(reply: object) -> None:
    m.nodes(m.per_key(reply, "nodes", 1)[0])


def _reply_record(reply: object) -> None:
    wire = m.per_key(reply, "records", 1)[0]
    if wire is not None:
        Validators.default().validate(Record.from_wire(wire), harness.NOW)


def _reply_providers(reply: object) -> None:
    entries = m.per_key(reply, "providers", 1)[0]
    if isinstance(entries, list) and len(entries) <= m.MAX_PROVIDERS:
        for entry in entries:
            m.contact(entry)


@target(FrameError)
def dht_reply(data: bytes) -> None:
    """A DHT reply read as ``dht.node``'s lookups read each kind (nodes, a record, providers)."""
    reply = unpack(data)
    m.is_server(reply)
    for read in (_reply_nodes, _reply_record, _reply_providers):
        with suppress(Refused, RecordError):
            read(reply)


@target(FrameError, RecordError)
def dht_record(data: bytes) -> None:
    """A record map through ``Record.from_wire`` and the default validators at ``harness.NOW``."""
    Validators.default().validate(Record.from_wire(unpack(data)), harness.NOW)


@target(RecordError)
def dht_name_value(data: bytes) -> None:
    """The value of a ``/name/`` record through ``dht.names.parse_name_value``."""
    parse_name_value(data)


@target()
def dht_relays(data: bytes) -> None:
    """The value of a peer's relays record through ``decode_relays``: it refuses nothing,
    it skips (at most eight addresses come out)."""
    assert len(decode_relays(data)) <= 8


@target(RecordError)
def shard_versions(data: bytes) -> None:
    """The payload of a model name's record through ``shards.names.decode_versions``."""
    decode_versions(data)


# --- documents ----------------------------------------------------------------------------


@target(ChangeError)
def crdt_change(data: bytes) -> None:
    """One change's wire bytes through ``crdt.change.decode_change`` (signature checked)."""
    decode_change(data)


@target(FrameError, ChangeError, Rejected)
def crdt_batch(data: bytes) -> None:
    """A pushed batch (a msgpack list of change bytes) decoded and applied, in order, to the
    document ``harness.DOC_NAME`` of ``harness.PUBLIC``, as a replica takes a peer's changes."""
    batch = unpack(data)
    if isinstance(batch, list):
        document = Document(harness.PUBLIC, harness.DOC_NAME)
        for wire in batch:
            document.receive(decode_change(wire, verify=False))
        document.get()


@target(FrameError, ReconcileError)
def crdt_reconcile(data: bytes) -> None:
    """A peer's reconciliation messages (a frame each) to one side of a session over
    ``harness.sync_keys(range(0, 300, 3))``, until the session ends."""
    reconciler = Reconciler(ItemSet(harness.sync_keys(range(0, 300, 3))))
    for message in harness.frames(data):
        if reconciler.receive(message) is None:
            return


# --- model shards -------------------------------------------------------------------------


@target(ManifestError)
def shard_manifest(data: bytes) -> None:
    """A manifest's bytes through ``decode_manifest`` (signature checked)."""
    decode_manifest(data)


@target(ValueError)
def safetensors_header(data: bytes) -> None:
    """A ``.safetensors`` JSON header (as a manifest carries it) through ``parse_header``."""
    parse_header(data)


# --- traversal requests and replies (the trio shell's parsing included) --------------------


@target(FrameError)
def relay(data: bytes) -> None:
    """A relay's answer to ``reserve`` (``parse_limits``), and the argument of
    ``relay.connect`` / ``relay.incoming`` (``peer_field``)."""
    value = unpack(data)
    with suppress(Malformed):
        parse_limits(value)
    with suppress(InvalidArgument):
        peer_field(value)


@target(FrameError)
def punch(data: bytes) -> None:
    """A hole-punch exchange request or reply: its addresses, each parsed as HOST:PORT, and
    the mapping it reports."""
    value = unpack(data)
    mapping_of(value)
    with suppress(Malformed, AddressError):
        for text in parse_addresses(value):
            HostPort.parse(text)


@target(FrameError)
def autonat(data: bytes) -> None:
    """AutoNAT: a request's ``exclude``, a dial-back request (peer and address parsed),
    a helper's answer and the verdict relayed to the asker."""
    value = unpack(data)
    reachable_of(value)
    Verdict().apply(value)
    with suppress(Malformed):
        parse_exclude(value)
    with suppress(Malformed, InvalidArgument, AddressError):
        peer_text, addr_text = parse_dial_back(value)
        to_peer(peer_text)
        HostPort.parse(addr_text)


# --- tensors: learning and experts --------------------------------------------------------


@target(FrameError, InvalidArgument, WireError, CodecError)
def learn_tensor_set(data: bytes) -> None:
    """A signed tensor set as a group member reads it: the head frame's contribution, then
    tensor frames through ``learn.wire.Decoder`` (or, for a lent set, the headers through
    ``chunk_counts``), the digest, and each tensor decoded."""
    stream = harness.frames(data)
    head = next(stream, None)
    Contribution.from_wire(field(head, "contribution", dict))
    if "lane" in head:
        chunk_counts(list(stream), Limits())
        return
    decoder, named = Decoder(Limits()), []
    for frame in stream:
        named += decoder.feed(frame)
    decoder.finish()
    digest_of(named)  # a peer that signs its own set makes this match the contribution's digest
    for _, encoded in named:
        decode_tensor(encoded)


@target(FrameError, CodecError)
def learn_codec(data: bytes) -> None:
    """``learn.compress.decode`` of ``[codec, dtype, shape, block, payload]``: it promises
    CodecError and nothing else for any fields of the types a Decoder passes on."""
    value = unpack(data)
    if isinstance(value, list) and len(value) == 5 and isinstance(value[4], bytes) \
            and isinstance(value[0], str) and isinstance(value[1], str) and isinstance(value[2], list):
        codec, dtype, shape, block, payload = value
        decode_tensor(Encoded(codec, dtype, tuple(shape), block, payload))


@target(FrameError, InvalidArgument)
def expert_tensors(data: bytes) -> None:
    """An ``experts.call`` argument's ``inputs`` (or a reply's ``outputs``) through
    ``experts.tensors.from_wire`` with the default ``[experts]`` limits."""
    config = ExpertsSection()
    expert_tensors_from_wire(field(unpack(data), "inputs", list), max_tensors=config.max_tensors,
                             max_bytes=config.max_request_bytes)

