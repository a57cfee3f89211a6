"""The control plane: a Unix socket in the data dir, and the client for it.

``meshctl`` and ``meshd.connect()`` talk to the local daemon through
``DATA_DIR/meshd.sock`` (mode 0600, and the connecting uid is checked), using
the same RPC frames as peers do, one socket connection per call.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator

import trio

from dht.ids import Contact
from dht.network import DhtError
from dht.records import RecordError
from nat.stun_client import StunFailure

from .address import AddressError, HostPort
from .doccontrol import crdt_methods
from .shards.control import shards_methods
from .identity import PeerId, PeerIdError
from .rpc import InvalidArgument, ResponseStream, RpcServer, Unavailable, unary_call
from .streams import SocketCallStream
from .transport import DialError
from .docclient import RemoteDocument

if TYPE_CHECKING:
    from .node import Node

SOCKET_FILE = "meshd.sock"
_MAX_FRAME = 16 << 20


class DaemonNotRunning(Exception):
    """No daemon answers on the data dir's control socket."""


def socket_path(data_dir: str | Path) -> Path:
    return Path(data_dir).expanduser() / SOCKET_FILE


# --- server side --------------------------------------------------------------


def _field(arg: object, name: str, kind: type) -> object:
    if not isinstance(arg, dict) or not isinstance(arg.get(name), kind):
        raise InvalidArgument(f"expected {{{name!r}: {kind.__name__}}}")
    return arg[name]


def _peer_field(arg: object) -> PeerId:
    try:
        return PeerId.from_string(_field(arg, "peer", str))
    except PeerIdError as exc:
        raise InvalidArgument(str(exc)) from None


def control_server(node: "Node") -> RpcServer:
    """The methods the control socket offers, bound to ``node``."""
    server = RpcServer(max_frame=_MAX_FRAME, max_calls_per_peer=64)

    async def id_(arg, ctx):
        return {"peer_id": str(node.peer_id), "address": str(node.address)}

    async def status(arg, ctx):
        return node.status()

    async def peers(arg, ctx):
        return node.peers()

    async def ping(arg, ctx):
        peer = _peer_field(arg)
        return {"peer_id": str(peer), "rtt_ms": round(await node.ping(peer) * 1000, 3)}

    async def connect(arg, ctx):
        if isinstance(arg, dict) and "via" in arg:
            relay = _peer_field({"peer": arg.get("via")})
            conn = await node.connect_via(relay, _peer_field(arg))
            return {"peer_id": str(conn.peer_id), "path": conn.path}
        try:
            peer = await node.connect(_field(arg, "addr", str))
        except AddressError as exc:
            raise InvalidArgument(str(exc)) from None
        return {"peer_id": str(peer), "path": "direct"}

    async def punch(arg, ctx):
        conn = await node.puncher.punch(_peer_field(arg))
        return {"punched": conn is not None, "path": conn.path if conn else None}

    async def relay(arg, ctx):
        if isinstance(arg, dict) and "reserve" in arg:
            await node.relay.reserve(_peer_field({"peer": arg["reserve"]}))
        return node.relay.status()

    async def disconnect(arg, ctx):
        return {"disconnected": node.disconnect(_peer_field(arg))}

    async def nat(arg, ctx):
        if isinstance(arg, dict) and arg.get("discover"):
            await node.stun.discover(node.stun_servers())
        if isinstance(arg, dict) and arg.get("autonat"):
            await node.autonat.check()
        return node.nat_status()

    async def stun(arg, ctx):
        try:
            server = HostPort.parse(_field(arg, "server", str))
            return {"server": str(server), "reflexive": await node.stun.query(server)}
        except (AddressError, DialError) as exc:
            raise InvalidArgument(str(exc)) from None
        except StunFailure as exc:
            raise Unavailable(str(exc)) from None

    async def call(arg, ctx):
        peer = _peer_field(arg)
        method = _field(arg, "method", str)
        timeout = arg.get("timeout", node.config.rpc.default_timeout)
        if not isinstance(timeout, (int, float)):
            raise InvalidArgument("timeout must be a number of seconds")
        return await node.rpc.call(peer, method, arg.get("arg"), timeout=timeout)

    for name, handler in (("id", id_), ("status", status), ("peers", peers), ("ping", ping),
                          ("connect", connect), ("disconnect", disconnect), ("call", call),
                          ("nat", nat), ("stun", stun), ("relay", relay), ("punch", punch)):
        server.register(name, handler)
    for name, handler in _dht_methods(node).items():
        server.register(name, _dht_errors(handler))
    for name, handler in {**crdt_methods(node), **shards_methods(node)}.items():
        server.register(name, handler)
    return server


def _dht_methods(node: "Node") -> dict:
    """``dht.put``, ``dht.get``, ``dht.provide``, ``dht.providers`` and ``dht.routing``."""
    dht = node.dht

    async def put(arg, ctx):
        key, value = _field(arg, "key", bytes), _field(arg, "value", bytes)
        ttl = arg.get("ttl")
        if ttl is not None and (not isinstance(ttl, (int, float)) or ttl <= 0):
            raise InvalidArgument("ttl must be a positive number of seconds")
        return {"key": key, "replicas": await dht.put(key, value, ttl=ttl)}

    async def get(arg, ctx):
        record = await dht.get(_field(arg, "key", bytes))
        if record is None:
            return None
        return {"key": record.key, "value": record.value, "author": str(PeerId(record.public_key)),
                "seq": record.seq, "expires": record.expires}

    async def provide(arg, ctx):
        key = _field(arg, "key", bytes)
        return {"key": key, "replicas": await dht.provide(key)}

    async def providers(arg, ctx):
        key = _field(arg, "key", bytes)
        count = arg.get("count", 20)
        if type(count) is not int or not 0 < count <= 1000:
            raise InvalidArgument("count must be an integer from 1 to 1000")
        found = await dht.find_providers(key, count)
        return [_contact(contact) for contact in found]

    async def routing(arg, ctx):
        info = dht.routing_info()
        info["peer_id"] = str(node.peer_id)
        info["contacts"] = [{"peer_id": str(PeerId(bytes.fromhex(c.pop("public_key")))), **c}
                            for c in info["contacts"]]
        return info

    return {"dht.put": put, "dht.get": get, "dht.provide": provide, "dht.providers": providers,
            "dht.routing": routing}


def _contact(contact: Contact) -> dict:
    return {"peer_id": str(PeerId(contact.public_key)), "addrs": list(contact.addrs)}


def _dht_errors(handler):
    """``handler`` with the DHT's errors as RPC errors: a refused record (unknown
    namespace, too large, another's key) is INVALID_ARGUMENT, the rest UNAVAILABLE."""

    async def wrapped(arg, ctx):
        try:
            return await handler(arg, ctx)
        except RecordError as exc:
            raise InvalidArgument(str(exc)) from None
        except DhtError as exc:
            raise Unavailable(f"DHT: {exc}") from None

    return wrapped


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


async def serve_control(node: "Node", *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Listen on the control socket until cancelled; remove it afterwards."""
    path = socket_path(node.data_dir)
    if path.exists():
        if await _answers(path):
            raise RuntimeError(f"another meshd is running with data dir {node.data_dir}")
        path.unlink()
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(64)
    server = control_server(node)
    my_uid = os.getuid()
    try:
        async with trio.SocketListener(sock) as listener, trio.open_nursery() as nursery:
            task_status.started()
            while True:
                stream = await listener.accept()
                if _peer_uid(stream.socket) not in (my_uid, 0):
                    await stream.aclose()
                    continue
                nursery.start_soon(_serve_one, server, stream)
    finally:
        path.unlink(missing_ok=True)


async def _serve_one(server: RpcServer, stream: trio.SocketStream) -> None:
    async with stream, trio.open_nursery() as nursery:
        await server.serve_call(SocketCallStream(stream, nursery), "control")
        nursery.cancel_scope.cancel()


async def _answers(path: Path) -> bool:
    try:
        stream = await trio.open_unix_socket(str(path))
    except OSError:
        return False
    await stream.aclose()
    return True


# --- client side --------------------------------------------------------------


class Client:
    """Talks to a running daemon.  Get one with :func:`connect`."""

    def __init__(self, path: Path):
        self.path = path

    async def _open(self) -> SocketCallStream:
        try:
            return SocketCallStream(await trio.open_unix_socket(str(self.path)))
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
                raise DaemonNotRunning(
                    f"no meshd is running with data dir {self.path.parent} "
                    f"(start one with `meshd start --data-dir {self.path.parent}`)"
                ) from None
            raise Unavailable(f"control socket {self.path}: {exc.strerror}") from None

    async def request(self, method: str, arg: object = None, timeout: float | None = 60) -> object:
        """Call a control method of the daemon."""
        return await unary_call(self._open, method, arg, timeout, _MAX_FRAME)

    def stream(self, method: str, arg: object = None) -> ResponseStream:
        """A server-streaming control method: ``async for item in client.stream(...)``."""
        return ResponseStream(self._open, method, arg, None, _MAX_FRAME)

    async def id(self) -> dict:
        return await self.request("id")

    async def status(self) -> dict:
        return await self.request("status")

    async def peers(self) -> list[dict]:
        return await self.request("peers")

    async def ping(self, peer: PeerId | str) -> float:
        """Round-trip time to ``peer`` in milliseconds."""
        return (await self.request("ping", {"peer": str(peer)}))["rtt_ms"]

    async def connect(self, addr: str, via: str | None = None) -> str:
        """Have the daemon dial ``PEERID@HOST:PORT``, or PEERID through relay ``via``.

        Returns the PeerId.
        """
        arg = {"addr": str(addr)} if via is None else {"peer": str(addr), "via": str(via)}
        return (await self.request("connect", arg))["peer_id"]

    async def punch(self, peer: str) -> bool:
        """Try hole punching to ``peer`` (reached through a relay) now; True if direct."""
        return (await self.request("punch", {"peer": str(peer)}, timeout=60))["punched"]

    async def relay(self, reserve: str | None = None) -> dict:
        """Relay reservations, after reserving a slot at relay PeerId ``reserve`` if given."""
        return await self.request("relay", {} if reserve is None else {"reserve": str(reserve)})

    async def disconnect(self, peer: PeerId | str) -> bool:
        return (await self.request("disconnect", {"peer": str(peer)}))["disconnected"]

    async def nat(self, discover: bool = False, autonat: bool = False) -> dict:
        """Reflexive addresses, NAT mapping and reachability.

        ``discover`` first asks the configured STUN servers and every
        connected peer, and classifies the mapping from their answers;
        ``autonat`` first asks peers to have a third peer dial us back.
        """
        return await self.request("nat", {"discover": discover, "autonat": autonat})

    async def stun(self, server: str) -> str:
        """Ask the STUN server at HOST:PORT for our reflexive address now."""
        return (await self.request("stun", {"server": server}))["reflexive"]

    async def call(self, peer: PeerId | str, method: str, arg: object = None,
                   timeout: float = 30.0) -> object:
        """Unary RPC to ``peer`` made by the daemon on our behalf."""
        return await self.request(
            "call", {"peer": str(peer), "method": method, "arg": arg, "timeout": timeout},
            timeout=timeout + 5,
        )

    async def dht_put(self, key: bytes, value: bytes, ttl: float | None = None) -> int:
        """Store ``value`` under ``key`` (``b"/open/NAME"`` or ``b"/owned/<our key hex>/NAME"``),
        signed by the daemon's key, for ``ttl`` seconds (default ``dht.record_ttl``).

        Returns how many other nodes took it; raises InvalidArgument when the
        record is refused (unknown namespace, value over 16 KiB, another's key).
        """
        arg = {"key": key, "value": value} if ttl is None else {"key": key, "value": value, "ttl": ttl}
        return (await self.request("dht.put", arg))["replicas"]

    async def dht_get(self, key: bytes) -> dict | None:
        """The best record found under ``key``: ``{key, value, author (PeerId),
        seq, expires (unix time)}``, or None."""
        return await self.request("dht.get", {"key": key})

    async def dht_provide(self, key: bytes) -> int:
        """Announce the daemon as a provider of ``key`` (re-announced until it
        stops); returns how many other nodes took the announcement."""
        return (await self.request("dht.provide", {"key": key}))["replicas"]

    async def dht_providers(self, key: bytes, count: int = 20) -> list[dict]:
        """Up to ``count`` providers of ``key``: ``[{peer_id, addrs}]``."""
        return await self.request("dht.providers", {"key": key, "count": count})

    async def document(self, ref: str, *, create: bool = False) -> "RemoteDocument":
        """The daemon's replica of document ``ref`` (``NAME`` or ``PEERID/NAME``),
        created (ours) or joined (another node's) if the daemon does not keep it yet."""
        await self.request("crdt.open", {"doc": ref, "create": create})
        return RemoteDocument(self, ref)

    async def documents(self) -> list[dict]:
        """Every document the daemon keeps: ref, changes, peers, writers, ..."""
        return await self.request("crdt.ls")

    async def publish_model(self, path: str | Path, name: str, version: int | None = None) -> dict:
        """Have the daemon publish the ``.safetensors`` file at ``path`` as ``name``
        (version: one above the registry's highest unless given); returns its
        id, name, version, bytes, chunks, tensors, publisher, created."""
        arg = {"path": str(Path(path).expanduser().resolve()), "name": name, "version": version}
        return await self.request("shards.publish", arg, timeout=None)

    def fetch_model(self, ref: str, out: str | Path | None = None) -> ResponseStream:
        """``async with client.fetch_model("run42/gpt@latest", "gpt.safetensors") as items``:
        progress dicts (``total_bytes``, ``have_bytes``, ``providers``...) while
        the daemon pulls, then ``{"done": True, id, ...}``; the file is written
        at ``out`` if given.  ``ref`` is NAME, NAME@VERSION, NAME@latest or a hex id."""
        arg = {"ref": ref, "out": None if out is None else str(Path(out).expanduser().resolve())}
        return self.stream("shards.fetch", arg)

    async def models(self) -> list[dict]:
        """The models the daemon keeps, with how many of their bytes are present."""
        return await self.request("shards.ls")

    async def dht_routing(self) -> dict:
        """The DHT routing table: mode, size, buckets, contacts (peer_id, addrs,
        bucket), and how many records and provided keys are held."""
        return await self.request("dht.routing")


@asynccontextmanager
async def connect(data_dir: str | Path = "~/.meshd") -> AsyncIterator[Client]:
    """A client for the daemon running with ``data_dir``.

    Raises DaemonNotRunning at once if no daemon answers there.
    """
    client = Client(socket_path(data_dir))
    await client.id()
    yield client
