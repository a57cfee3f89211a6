"""What a service is, and all a service sees of the node.

A *service* is one capability of a node (NAT traversal, the DHT, documents,
shards, ...): one subpackage of :mod:`meshd.services` with one shape,
:class:`Service`.  It brings its peer RPC methods, its control methods, its
background work and its status; its config section is handed to it by the
composition root (:mod:`meshd.daemon`), which builds the services in order
and passes each the others it needs.

The node core implements :class:`Host`, the narrow surface a service may use.
A service never touches the node class or its private members, so a fake
``Host`` can stand in for the node in a service's unit test, and the core
imports no service.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Mapping, Protocol, Sequence

import trio

from crdt.document import Document, Transaction
from dht.ids import Contact

from .address import HostPort, PeerAddr
from .identity import Identity, PeerId
from .peerstore import PeerRecord
from .rpc.peer import PeerRpc
from .transport import Endpoint, PeerConnection

Handler = Callable[..., Any]
"""An RPC handler: ``async def (arg, ctx)``, an async generator, or a bidi
handler ``async def (channel, ctx)`` (see :class:`meshd.rpc.RpcServer`)."""


class Method:
    """An RPC handler with its kind spelled out (``"bidi"``, ``"client_stream"``);
    a plain handler in :meth:`Service.rpc_methods` or :meth:`Service.control_methods`
    has its kind inferred."""

    def __init__(self, handler: Handler, kind: str):
        self.handler = handler
        self.kind = kind


class Service(Protocol):
    """One capability of a node.

    ``name`` is the capability's one name: its subpackage, its config
    section, the prefix of its RPC and control methods, its ``meshctl``
    group, its key in ``meshctl status``.
    """

    name: str

    def rpc_methods(self) -> dict[str, Handler | Method]:
        """The methods peers may call, by full name; registered before :meth:`run`."""

    def control_methods(self) -> dict[str, Handler | Method]:
        """The methods of the local control socket (``meshctl``, the client library)."""

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Do the service's background work until cancelled; call
        ``task_status.started()`` once the service can be used."""

    def status(self) -> dict:
        """A short summary for ``meshctl status``."""

    def close(self) -> None:
        """Release files and databases; called once :meth:`run` has ended."""


Lookup = Callable[[PeerId, dict[str, str]], Awaitable[Sequence[str]]]
"""Where a peer may be dialed: HOST:PORT texts found by asking the network (a lookup
may also connect to the peer itself); what it tried and failed goes in the dict
(what was tried -> why it failed)."""


MAX_NAME = 128  # characters in a name users give (a training group, an expert)


def check_name(value: object, what: str) -> str:
    """``value`` if it is a usable name (1-128 printable characters); ValueError naming ``what`` otherwise."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME or not value.isprintable():
        raise ValueError(f"{what} is 1-{MAX_NAME} printable characters, not {value!r:.40}")
    return value


class Replica(Protocol):
    """One replicated document as a service holds it (the crdt service's replica)."""

    doc: Document
    peers: dict[PeerId, None]
    ref: str


class Documents(Protocol):
    """Replicated documents (the crdt service, which the root wires in): where registries
    live (the models ``shards`` keeps, the experts ``experts`` serves)."""

    def is_own(self, ref: str) -> bool: ...
    async def open(self, ref: str, *, create: bool = False) -> Replica: ...
    def write(self, replica: Replica, fill: Callable[[Transaction], None]) -> object: ...
    async def sync(self, replica: Replica, peer: PeerId) -> dict: ...


class Providers(Protocol):
    """Provider records (the DHT service's node, which the root wires in): who has a key.
    Replicas of a document, holders of a model, members of a training group and servers
    of an expert find each other through them; a contact carries the provider's
    addresses as its record gave them."""

    joined: trio.Event  # set once lookups can find others (before, a lookup finds nobody)

    async def provide(self, key: bytes) -> int: ...
    def unprovide(self, key: bytes) -> None: ...
    async def find_providers(self, key: bytes, count: int) -> Sequence[Contact]: ...


class StateStore(Protocol):
    """Sets of named tensors moved as shards (the shards service, which the root wires in):
    how a training member hands its whole state to one that joins, which takes it from
    every member holding the same bits at once."""

    async def publish_tensors(self, name: str, tensors: Mapping[str, Any], *, version: int = 0) -> bytes:
        """Keep ``tensors`` (a state_dict) as this node's model ``name`` and serve it to peers
        that ask for its id (returned); any model this node published under ``name`` before
        is dropped (unpinned, its chunks collected)."""

    async def fetch_tensors(self, model_id: bytes, providers: Sequence[PeerId]) -> dict:
        """The tensors of model ``model_id``, every chunk verified, from ``providers`` (the
        manifest from the first that has it, chunks from all of them at once) into memory:
        nothing is written to disk.  Raises an exception saying why if it cannot
        (the shards service's FetchError, an RpcError)."""


class Route(Protocol):
    """A way to reach a peer that has no direct address, such as a relay."""

    async def reach(self, peer: PeerId, record: PeerRecord | None,
                    errors: dict[str, str]) -> PeerConnection | None:
        """A connection to ``peer`` if this route finds one; failures are added
        to ``errors`` (what was tried -> why it failed)."""

    async def via(self, hop: PeerId, peer: PeerId) -> PeerConnection:
        """A connection to ``peer`` through ``hop``; raises an RpcError if it fails."""


class Host(Protocol):
    """The node core as a service sees it."""

    peer_id: PeerId
    identity: Identity
    data_dir: Path
    rpc: PeerRpc
    endpoint: Endpoint
    bootstrap: list[PeerAddr]

    @property
    def listen_address(self) -> HostPort:
        """The address of the node's UDP socket (a wildcard host stays a wildcard)."""

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the background for as long as the node runs."""

    def live(self, peer: PeerId) -> PeerConnection | None:
        """The open connection to ``peer``, or None (never dials)."""

    def connected(self) -> list[PeerId]:
        """The peers with an open connection."""

    async def connection(self, peer: PeerId, *, hints: Sequence[str] = (),
                         find: bool = True) -> PeerConnection:
        """The connection to ``peer``, dialing if needed (see :meth:`meshd.Node.connection`)."""

    async def wait_connected(self, peer: PeerId) -> None:
        """Return once a connection to ``peer`` is up."""

    async def wait_connection_change(self, peer: PeerId) -> None:
        """Return when the next connection to ``peer`` is registered."""

    def recently_connected(self, address: tuple[str, int]) -> bool:
        """Whether a connection with ``address`` is open or closed lately."""

    def advertised_addresses(self) -> list[str]:
        """HOST:PORT texts where strangers may dial this node directly."""

    def add_lookup(self, lookup: Lookup) -> None:
        """Ask ``lookup`` for a peer's addresses when none known answers."""

    def add_route(self, route: Route) -> None:
        """Try ``route`` when no address of a peer answers."""

    def add_address_source(self, source: Callable[[], Iterable[HostPort]]) -> None:
        """Add what ``source`` returns to :meth:`advertised_addresses`."""

    def add_identify(self, fields: Callable[[], dict]) -> None:
        """Merge what ``fields`` returns into this node's ``identify`` answer."""

    def protect(self, peers: Callable[[], Iterable[PeerId]]) -> None:
        """Never close the connections to ``peers()`` for being idle."""

    def add_farewell(self, goodbye: Callable[[], Awaitable[None]]) -> None:
        """Await ``goodbye()`` when the node stops, before its connections close (tell
        peers what they would otherwise learn from a timeout); time-bounded by the node."""
