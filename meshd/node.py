"""The node core: identity, one QUIC endpoint, connections, RPC, the peer store,
bootstrap and the control socket.  It knows no service.

:func:`meshd.open_node` (the composition root, :mod:`meshd.daemon`) builds a
node and its services::

    async with meshd.open_node(data_dir="~/.meshd", listen="127.0.0.1:0") as node:
        node.rpc.register("echo", echo)
        reply = await node.rpc.call(peer_id, "echo", {"x": 1}, timeout=5)

Services see the node through :class:`meshd.service.Host`: they register
their RPC methods, lookups (the DHT), routes (relays), address sources (STUN,
port mapping, AutoNAT) and identify fields, and the node calls them back.

There is at most one connection per peer, reused by every call.  When both
sides dial each other at once, the connection dialed by the smaller PeerId
wins on both sides; otherwise a new connection replaces an old one (the peer
restarted, or the old path died).
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Sequence

import trio

from ._version import __version__
from .address import AddressError, HostPort, PeerAddr, plain_address
from .config import CoreConfig
from .control import serve_control
from .control.server import control_server
from .identity import PeerId, load_or_create_identity
from .peerstore import PeerStore
from .rpc import InvalidArgument, RpcError, Unavailable
from .rpc.args import field, peer_field
from .rpc.peer import PeerRpc
from .rpc.workers import Workers
from .service import Lookup, Method, Route, Service
from .transport import DialError, Endpoint, PeerConnection
from .transport.endpoint import VIRTUAL_HOST, is_loopback

log = logging.getLogger("meshd.node")

_RACE_WINDOW = 10.0  # seconds within which two connections to one peer count as a race
_RETIRE_GRACE = 30.0  # seconds a replaced connection may finish its calls
_MAX_RECENT = 4096
RECENT_CONTACT = 180.0  # seconds a closed connection's address counts as recently connected
AGENT = f"meshd/{__version__}"


class ServiceOff(Unavailable):
    """A call to a service this node does not run."""


class Node:
    """A running meshd node: the core every service plugs into (see :class:`meshd.service.Host`).

    Create it with :func:`meshd.open_node`.  ``services`` maps each service's
    name to the service; ``off`` names the known services left out.
    """

    def __init__(self, data_dir: Path, config: CoreConfig):
        # Addresses from the config are parsed once, here, so a bad one fails
        # now with its reason rather than later in a background task.
        self.bootstrap = [PeerAddr.parse(text) for text in config.node.bootstrap]
        self.data_dir = data_dir
        self.config = config
        self.identity = load_or_create_identity(data_dir)
        self.peer_id: PeerId = self.identity.peer_id
        self.peerstore = PeerStore(data_dir, config.peers.max_addresses_per_peer)
        self.endpoint = Endpoint(
            self.identity,
            config.transport,
            on_connection=self._on_connection,
            on_connection_lost=self._on_connection_lost,
        )
        self.rpc = PeerRpc(self.connection, config.rpc)
        self.started_at = trio.current_time()
        self.services: dict[str, Service] = {}
        self.off: tuple[str, ...] = ()
        self._conns: dict[PeerId, PeerConnection] = {}
        self._dialing: dict[PeerId, trio.Event] = {}
        self._connected_events: dict[PeerId, trio.Event] = {}
        self._recent_addresses: dict[tuple[str, int], float] = {}  # closed connections, when
        self._observed: dict[str, None] = {}  # our HOST:PORT as direct peers saw it, newest last
        self._nursery: trio.Nursery | None = None
        self._call_workers: Workers | None = None  # the tasks that serve calls, while running
        self._lookups: list[Lookup] = []
        self._routes: list[Route] = []
        self._address_sources: list[Callable[[], Iterable[HostPort]]] = []
        self._identify_fields: list[Callable[[], dict]] = []
        self._protected: list[Callable[[], Iterable[PeerId]]] = []
        self._farewells: list[Callable[[], Awaitable[None]]] = []
        self.rpc.register("ping", _ping)
        self.rpc.register("identify", self._identify)

    # --- services --------------------------------------------------------------

    def add_service(self, service: Service) -> None:
        """Plug ``service`` in: its peer RPC methods now, its run() when the node starts."""
        if service.name in self.services:
            raise ValueError(f"a service named {service.name!r} is already added")
        for name, handler in service.rpc_methods().items():
            if isinstance(handler, Method):
                self.rpc.register(name, handler.handler, kind=handler.kind)
            else:
                self.rpc.register(name, handler)
        self.services[service.name] = service

    def service(self, name: str) -> Any:
        """The service called ``name``; ServiceOff if this node does not run it."""
        try:
            return self.services[name]
        except KeyError:
            raise ServiceOff(_off_message(name, self.off)) from None

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the background until the node stops."""
        self._nursery.start_soon(fn, *args)

    def add_lookup(self, lookup: Lookup) -> None:
        self._lookups.append(lookup)

    def add_route(self, route: Route) -> None:
        self._routes.append(route)

    def add_address_source(self, source: Callable[[], Iterable[HostPort]]) -> None:
        self._address_sources.append(source)

    def add_identify(self, fields: Callable[[], dict]) -> None:
        self._identify_fields.append(fields)

    def protect(self, peers: Callable[[], Iterable[PeerId]]) -> None:
        self._protected.append(peers)

    def add_farewell(self, goodbye: Callable[[], Awaitable[None]]) -> None:
        self._farewells.append(goodbye)

    async def farewell(self) -> None:
        """Run every service's goodbye at once (:meth:`add_farewell`), while the node still runs;
        one that fails is logged.  The caller bounds the time (:func:`meshd.open_node`: 2 s)."""
        async def say(goodbye: Callable[[], Awaitable[None]]) -> None:
            try:
                await goodbye()
            except Exception:  # noqa: BLE001  (a goodbye is a courtesy: the node stops anyway)
                log.warning("a goodbye failed", exc_info=True)

        async with trio.open_nursery() as nursery:
            for goodbye in self._farewells:
                nursery.start_soon(say, goodbye)

    # --- addresses -------------------------------------------------------------

    @property
    def listen_address(self) -> HostPort:
        host, port = self.endpoint.local_address
        return HostPort(host, port)

    @property
    def address(self) -> PeerAddr:
        """The address others can dial, with a wildcard bind shown as loopback."""
        hp = self.listen_address
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(hp.host, hp.host)
        return PeerAddr(self.peer_id, HostPort(host, hp.port))

    def advertised_addresses(self) -> list[str]:
        """HOST:PORT texts where strangers may dial us directly, for the DHT:
        the listen address unless it is a wildcard, then what the address
        sources say (NAT-PMP mapping, STUN, AutoNAT).  Never a relayed or
        virtual address.  On a wildcard listen address, the addresses direct
        peers saw us at with our own port stand in for it (no port
        translation on the way: a LAN or a public host)."""
        listen = self.listen_address
        found = [HostPort.parse(text) for text in self._observed] if listen.host in ("0.0.0.0", "::") else [listen]
        for source in self._address_sources:
            found += source()
        return list(dict.fromkeys(str(hp) for hp in found))

    def _note_observed(self, text: object) -> None:
        """Remember where a direct peer saw us, if it kept our listen port (at most 4, newest kept)."""
        try:
            hp = HostPort.parse(text) if isinstance(text, str) else None
        except AddressError:
            return
        if hp is None or hp.port != self.listen_address.port:
            return
        self._observed.pop(str(hp), None)
        self._observed[str(hp)] = None
        while len(self._observed) > 4:
            self._observed.pop(next(iter(self._observed)))

    # --- connections -----------------------------------------------------------

    def _on_connection(self, conn: PeerConnection) -> None:
        peer = conn.peer_id
        old = self._conns.get(peer)
        if old is not None and old is not conn:
            if old.path != "direct" and conn.path == "direct":
                conn.path = "punched"  # found while relayed (or racing a punched one): punching worked
            keep, drop = self._pick(old, conn)
            self._nursery.start_soon(self._retire, drop)
            if keep is old:
                return
        self._conns[peer] = conn
        conn.on_stream = self._serve_stream
        waiting = self._connected_events.pop(peer, None)
        if waiting is not None:
            waiting.set()
        log.info("connected to %s at %s:%s (%s)", peer, *conn.remote_addr[:2],
                 "dialed" if conn.dialed else "accepted")
        self._nursery.start_soon(self._learn_about, conn)

    async def _retire(self, conn: PeerConnection) -> None:
        """Close a replaced connection once its calls have finished (at most ``_RETIRE_GRACE`` s)."""
        with trio.move_on_after(_RETIRE_GRACE):
            await conn.wait_idle()
        conn.close_replaced()

    def _pick(self, old: PeerConnection, new: PeerConnection) -> tuple[PeerConnection, PeerConnection]:
        """(keep, drop) for two connections to one peer, the same choice on both sides.

        A path without a relay beats a relayed one; otherwise see the module docstring.
        """
        if (old.path == "relayed") != (new.path == "relayed"):
            return (old, new) if new.path == "relayed" else (new, old)
        racing = new.created_at - old.created_at < _RACE_WINDOW and old.dialed != new.dialed
        if not racing:
            return new, old
        dialed_by_smaller = old if old.dialed == (self.peer_id < old.peer_id) else new
        return dialed_by_smaller, (new if dialed_by_smaller is old else old)

    def recently_connected(self, address: tuple[str, int]) -> bool:
        """Whether a connection with ``address`` is open, or closed less than
        ``RECENT_CONTACT`` seconds ago (its NAT may still let us in)."""
        if any(plain_address(conn.remote_addr) == address for conn in self._conns.values()):
            return True
        when = self._recent_addresses.get(address)
        return when is not None and trio.current_time() - when < RECENT_CONTACT

    def _on_connection_lost(self, conn: PeerConnection) -> None:
        if _direct_address(conn) is not None:
            if len(self._recent_addresses) >= _MAX_RECENT:
                self._recent_addresses.pop(next(iter(self._recent_addresses)))
            self._recent_addresses[plain_address(conn.remote_addr)] = trio.current_time()
        if self._conns.get(conn.peer_id) is conn:
            del self._conns[conn.peer_id]
            log.info("lost connection to %s: %s", conn.peer_id, conn.close_reason)
            self.peerstore.seen(conn.peer_id)

    def _serve_stream(self, conn: PeerConnection, stream) -> None:
        remote = _direct_address(conn)
        counted = remote is not None and (self.config.transport.limit_loopback or not is_loopback(remote[0]))
        info = {"remote": remote, "path": conn.path, "address": remote[0] if counted else None}
        self._call_workers.submit(stream, conn.peer_id, info)

    async def _learn_about(self, conn: PeerConnection) -> None:
        """Ask a new peer who it is and where it listens; store what it says."""
        peer = conn.peer_id
        remote = _direct_address(conn)
        if conn.dialed and remote is not None:
            self.peerstore.add_addresses(peer, [_hostport(remote)])
        try:
            info = await self.rpc.call(peer, "identify", None, timeout=10)
        except Exception as exc:  # a peer that cannot identify is still a peer
            log.debug("identify %s failed: %s", peer, exc)
            return
        self._note_observed(info.get("observed") if isinstance(info, dict) else None)
        listen = _listen_addresses(info, remote)
        if listen:
            self.peerstore.add_addresses(peer, listen)
        relays = info.get("relays") if isinstance(info, dict) else None
        if isinstance(relays, list) and all(isinstance(r, str) for r in relays):
            self.peerstore.set_relays(peer, relays)
        agent = info.get("agent") if isinstance(info, dict) else None
        self.peerstore.seen(peer, rtt_ms=_ms(conn.rtt), path=conn.path,
                            agent=agent if isinstance(agent, str) else None)

    async def connection(self, peer: PeerId, *, hints: Sequence[str] = (),
                         find: bool = True) -> PeerConnection:
        """The live connection to ``peer``, dialing if needed: its stored
        addresses, then ``hints`` (HOST:PORT heard of elsewhere), then the
        routes (relays), then (if ``find``) the addresses the lookups (the
        DHT) find for it.

        Raises Unavailable when no address is known or none answers.
        """
        conn = self.live(peer)
        if conn is not None:
            return conn
        if peer == self.peer_id:
            raise InvalidArgument("cannot connect to ourselves")
        pending = self._dialing.get(peer)
        if pending is not None:
            await pending.wait()
            conn = self._conns.get(peer)
            if conn is None:
                raise Unavailable(f"could not reach {peer}")
            return conn
        record = self.peerstore.get(peer)
        errors: dict[str, str] = {}  # what was tried -> why it failed
        conn = await self._dial_any(peer, [*(record.addrs if record else []), *hints], errors)
        if conn is not None:
            return conn
        for route in self._routes:
            conn = await route.reach(peer, record, errors)
            if conn is not None:
                return conn
        if find:
            for lookup in self._lookups:
                addrs = await lookup(peer, errors)  # the lookup itself may connect us to the peer
                conn = self.live(peer) or await self._dial_any(peer, addrs, errors)
                if conn is not None:
                    return conn
        if not errors:
            raise Unavailable(f"no known address for {peer}; connect to PEERID@HOST:PORT first")
        raise Unavailable(f"could not reach {peer}: " + "; ".join(errors.values()))

    def live(self, peer: PeerId) -> PeerConnection | None:
        """The open connection to ``peer``, or None (never dials)."""
        conn = self._conns.get(peer)
        return conn if conn is not None and conn.close_reason is None else None

    def connected(self) -> list[PeerId]:
        """The peers with an open connection."""
        return list(self._conns)

    async def _dial_any(self, peer: PeerId, addrs: Sequence[str],
                        errors: dict[str, str]) -> PeerConnection | None:
        """Dial ``addrs`` in turn, skipping those in ``errors``; the first
        connection, or None with each failure added to ``errors``."""
        for text in addrs:
            if text in errors:
                continue
            try:
                return await self._dial(PeerAddr(peer, HostPort.parse(text)))
            except (DialError, AddressError) as exc:
                errors[text] = str(exc)
        return None

    async def _dial(self, addr: PeerAddr) -> PeerConnection:
        event = self._dialing.setdefault(addr.peer_id, trio.Event())
        try:
            conn = await self.endpoint.dial(addr.host, addr.port, addr.peer_id)
        finally:
            if self._dialing.get(addr.peer_id) is event:
                del self._dialing[addr.peer_id]
            event.set()
        return self._conns.get(addr.peer_id, conn)

    async def connect(self, addr: PeerAddr | str) -> PeerId:
        """Dial ``PEERID@HOST:PORT`` (reusing a live connection) and return the PeerId.

        Raises AddressError for a malformed address and Unavailable when the
        dial fails, including when a different key answers there.
        """
        if isinstance(addr, str):
            addr = PeerAddr.parse(addr)
        if addr.peer_id == self.peer_id:
            raise InvalidArgument("that address is this node's own")
        if self.live(addr.peer_id) is None:
            try:
                await self._dial(addr)
            except DialError as exc:
                raise Unavailable(str(exc)) from None
        self.peerstore.add_addresses(addr.peer_id, [str(addr.hostport)])
        return addr.peer_id

    async def connect_via(self, hop: PeerId, peer: PeerId) -> PeerConnection:
        """Reach ``peer`` through ``hop`` (a relay) with the first route that offers it."""
        if not self._routes:
            raise ServiceOff(_off_message("nat", self.off))
        return await self._routes[0].via(hop, peer)

    def disconnect(self, peer: PeerId) -> bool:
        """Close the connection to ``peer``; False if there was none."""
        conn = self._conns.pop(peer, None)
        if conn is None:
            return False
        conn.close(reason="disconnected by request")
        log.info("disconnected from %s", peer)
        return True

    async def wait_connection_change(self, peer: PeerId) -> None:
        """Return when the next connection to ``peer`` is registered (a new or better path)."""
        await self._connected_events.setdefault(peer, trio.Event()).wait()

    async def wait_connected(self, peer: PeerId) -> None:
        """Return once a connection to ``peer`` is up (whoever dialed)."""
        while peer not in self._conns:
            await self._connected_events.setdefault(peer, trio.Event()).wait()

    def peers(self) -> list[dict]:
        """One dict per connected peer: id, address, path, direction, RTT, how long
        connected, open streams, and the datagram size in use (path MTU discovery)."""
        now = trio.current_time()
        return [
            {
                "peer_id": str(peer),
                "address": _hostport(conn.remote_addr) if _direct_address(conn) else conn.path,
                "path": conn.path,
                "direction": "out" if conn.dialed else "in",
                "rtt_ms": _ms(conn.rtt),
                "connected_s": round(now - conn.created_at, 3),
                "streams": conn.open_streams,
                "datagram": conn.datagram_size,
            }
            for peer, conn in sorted(self._conns.items(), key=lambda kv: str(kv[0]))
        ]

    async def ping(self, peer: PeerId, timeout: float = 5.0) -> float:
        """Round-trip time of one ``ping`` call, in seconds."""
        start = trio.current_time()
        await self.rpc.call(peer, "ping", None, timeout=timeout)
        rtt = trio.current_time() - start
        self.peerstore.seen(peer, rtt_ms=rtt * 1000)
        return rtt

    async def identify(self, peer: PeerId, timeout: float = 10.0) -> dict:
        """What ``peer`` says of itself: listen addresses, where it sees us, its methods."""
        return await self.rpc.call(peer, "identify", None, timeout=timeout)

    async def _identify(self, arg: object, ctx) -> dict:
        remote = ctx.info.get("remote")
        info = {
            "peer_id": str(self.peer_id),
            "listen": [str(self.listen_address)],
            "observed": _hostport(remote) if remote else None,
            "services": self.rpc.server.methods,
            "agent": AGENT,
            "protocol": "meshd/1",
            "relays": [],
            "time": time.time(),  # unix seconds: lets a peer see how far our clocks differ
        }
        for fields in self._identify_fields:
            info.update(fields())
        return info

    def status(self) -> dict:
        """What ``meshctl status`` shows: the core's figures, then one entry per service."""
        status = {
            "peer_id": str(self.peer_id),
            "address": str(self.address),
            "listen": str(self.listen_address),
            "agent": AGENT,
            "uptime_s": round(trio.current_time() - self.started_at, 1),
            "connections": len(self._conns),
            "known_peers": len(self.peerstore.all()),
            "bootstrap": [str(addr) for addr in self.bootstrap if addr.peer_id != self.peer_id],
            "services": self.rpc.server.methods,
            "data_dir": str(self.data_dir),
            "transport": dict(self.endpoint.stats),
        }
        for name, service in self.services.items():
            status[name] = service.status()
        for name in self.off:
            status[name] = "off"
        return status

    # --- bootstrap -------------------------------------------------------------

    async def _keep_connected(self, addr: PeerAddr) -> None:
        """Stay connected to a bootstrap peer: dial with backoff, redial when lost."""
        delay = 0.25
        cap = self.config.peers.bootstrap_max_backoff
        while True:
            conn = self.live(addr.peer_id)
            if conn is not None:
                delay = 0.25
                await conn.terminated.wait()
                continue
            try:
                await self.connect(addr)
                continue
            except RpcError as exc:
                log.warning("bootstrap %s failed (retry in %.1f s): %s", addr.hostport, delay, exc)
            await trio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(cap, delay * 2)

    def close_idle(self, older_than: float) -> list[PeerId]:
        """Close connections that have had no stream for ``older_than`` seconds,
        except to peers this node depends on: bootstrap peers and those a
        service protects (relays in either direction).  Returns the peers closed."""
        now = trio.current_time()
        keep = {addr.peer_id for addr in self.bootstrap}
        for protected in self._protected:
            keep.update(protected())
        idle = [conn for peer, conn in self._conns.items() if peer not in keep
                and conn.open_streams == 0 and now - conn.last_stream_at >= older_than]
        for conn in idle:
            del self._conns[conn.peer_id]
            conn.close(reason=f"idle for {older_than:g} s")
        return [conn.peer_id for conn in idle]

    async def _close_idle_loop(self, older_than: float) -> None:
        while True:
            await trio.sleep(older_than / 4)
            closed = self.close_idle(older_than)
            if closed:
                log.debug("closed %d idle connections", len(closed))

    # --- running -----------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen, serve the control socket, start the services in the order
        they were added, and keep the bootstrap peers connected, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._call_workers = Workers(nursery, self.rpc.server.serve_call)
            host_port = HostPort.parse(self.config.node.listen, allow_zero_port=True)
            await nursery.start(self.endpoint.serve, host_port.host, host_port.port)
            server = control_server(self._control_methods(), self._explain_unknown)
            await nursery.start(serve_control, self.data_dir, server)
            for service in self.services.values():
                await nursery.start(service.run)
            if self.config.transport.close_idle_after > 0:
                nursery.start_soon(self._close_idle_loop, self.config.transport.close_idle_after)
            for addr in self.bootstrap:
                if addr.peer_id == self.peer_id:
                    log.info("skipping bootstrap entry %s: it is this node", addr.hostport)
                    continue
                nursery.start_soon(self._keep_connected, addr)
            log.info("meshd %s listening at %s", __version__, self.address)
            task_status.started()

    def close_connections(self) -> None:
        """Close every connection, telling each peer the node is shutting down."""
        for conn in list(self._conns.values()):
            conn.close(reason="node shutting down")
        self._conns.clear()

    def close(self) -> None:
        """Release the services' files (in reverse order) and the peer store; after :meth:`run`."""
        for service in reversed(list(self.services.values())):
            service.close()
        self.peerstore.close()

    # --- the control socket --------------------------------------------------------

    def _control_methods(self) -> dict[str, Callable]:
        """The core's control methods, then every service's."""
        methods = {"id": self._control_id, "status": self._control_status, "peers": self._control_peers,
                   "ping": self._control_ping, "connect": self._control_connect,
                   "disconnect": self._control_disconnect, "call": self._control_call}
        for service in self.services.values():
            methods.update(service.control_methods())
        return methods

    def _explain_unknown(self, method: str) -> RpcError | None:
        """The error for a control method of a service that is off."""
        for name in self.off:
            if method == name or method.startswith(name + "."):
                return ServiceOff(_off_message(name, self.off))
        return None

    async def _control_id(self, arg, ctx) -> dict:
        return {"peer_id": str(self.peer_id), "address": str(self.address)}

    async def _control_status(self, arg, ctx) -> dict:
        return self.status()

    async def _control_peers(self, arg, ctx) -> list[dict]:
        return self.peers()

    async def _control_ping(self, arg, ctx) -> dict:
        peer = peer_field(arg)
        return {"peer_id": str(peer), "rtt_ms": round(await self.ping(peer) * 1000, 3)}

    async def _control_connect(self, arg, ctx) -> dict:
        if isinstance(arg, dict) and "via" in arg:
            conn = await self.connect_via(peer_field(arg, "via"), peer_field(arg))
            return {"peer_id": str(conn.peer_id), "path": conn.path}
        try:
            peer = await self.connect(field(arg, "addr", str))
        except AddressError as exc:
            raise InvalidArgument(str(exc)) from None
        return {"peer_id": str(peer), "path": "direct"}

    async def _control_disconnect(self, arg, ctx) -> dict:
        return {"disconnected": self.disconnect(peer_field(arg))}

    async def _control_call(self, arg, ctx) -> object:
        peer = peer_field(arg)
        method = field(arg, "method", str)
        timeout = arg.get("timeout", self.config.rpc.default_timeout)
        if not isinstance(timeout, (int, float)):
            raise InvalidArgument("timeout must be a number of seconds")
        return await self.rpc.call(peer, method, arg.get("arg"), timeout=timeout)


def _off_message(name: str, off: Sequence[str]) -> str:
    if name in off:
        return f"the {name} service is off on this node (add it to [node] services)"
    return f"this node runs no {name} service"


async def _ping(arg: object, ctx) -> object:
    """Echo the argument: a liveness and round-trip check."""
    return arg


def _hostport(addr: tuple) -> str:
    return str(HostPort(*plain_address(addr)))


def _direct_address(conn: PeerConnection) -> tuple | None:
    """The peer's address on our UDP socket, or None over a virtual path (relay, extra socket)."""
    return None if conn.remote_addr[0] == VIRTUAL_HOST else conn.remote_addr


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _listen_addresses(info: object, remote: tuple | None) -> list[str]:
    """The peer's listen addresses; wildcard hosts become where we saw it (dropped if relayed)."""
    if not isinstance(info, dict) or not isinstance(info.get("listen"), list):
        return []
    seen_host = None if remote is None else _hostport(remote).rpartition(":")[0].strip("[]")
    out = []
    for text in info["listen"][:8]:
        try:
            hp = HostPort.parse(text) if isinstance(text, str) else None
        except AddressError:
            continue
        if hp is None:
            continue
        if hp.host in ("0.0.0.0", "::"):
            if seen_host is None:
                continue
            hp = HostPort(seen_host, hp.port)
        out.append(str(hp))
    return out
