"""The node: identity, one QUIC endpoint, RPC, the peer store and bootstrap.

``open_node`` is the way in::

    async with meshd.open_node(data_dir="~/.meshd", listen="127.0.0.1:0") as node:
        node.rpc.register("echo", echo)
        reply = await node.rpc.call(peer_id, "echo", {"x": 1}, timeout=5)

There is at most one connection per peer, reused by every call.  When both
sides dial each other at once, the connection dialed by the smaller PeerId
wins on both sides; otherwise a new connection replaces an old one (the peer
restarted, or the old path died).
"""

from __future__ import annotations

import logging
import math
import random
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Sequence

import trio

from dht.network import DhtError

from ._version import __version__
from .address import AddressError, HostPort, PeerAddr, plain_address
from .autonat import RECENT_CONTACT, AutoNat
from .portmap import PortMapper
from .punch import HolePuncher
from .relay import Relay
from .config import Config
from .control import serve_control
from .dhtrpc import create_dht, run_dht
from .replication import Replication
from .shards.service import Shards
from .identity import PeerId, PeerIdError, load_or_create_identity
from .peerrpc import PeerRpc
from .peerstore import PeerRecord, PeerStore
from .stun import NodeStun
from .transport import DialError, Endpoint, PeerConnection
from .transport.connection import CLOSE_REPLACED
from .transport.endpoint import VIRTUAL_HOST
from .rpc import InvalidArgument, RpcError, Unavailable

log = logging.getLogger("meshd.node")

_RACE_WINDOW = 10.0  # seconds within which two connections to one peer count as a race
_RETIRE_GRACE = 30.0  # seconds a replaced connection may finish its calls
_MAX_RECENT = 4096
AGENT = f"meshd/{__version__}"


class Node:
    """A running meshd node.  Create it with :func:`open_node`."""

    def __init__(self, data_dir: Path, config: Config):
        # Addresses from the config are parsed once, here, so a bad one fails
        # now with its reason rather than later in a background task.
        self.bootstrap = [PeerAddr.parse(text) for text in config.node.bootstrap]
        self.configured_stun = [HostPort.parse(text) for text in config.nat.stun_servers]
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
        self.stun = NodeStun(self.endpoint)
        self.rpc = PeerRpc(self, config.rpc)
        self.started_at = trio.current_time()
        self._conns: dict[PeerId, PeerConnection] = {}
        self._dialing: dict[PeerId, trio.Event] = {}
        self._connected_events: dict[PeerId, trio.Event] = {}
        self._recent_addresses: dict[tuple[str, int], float] = {}  # closed connections, when
        self._observed: dict[str, None] = {}  # our HOST:PORT as direct peers saw it, newest last
        self._nursery: trio.Nursery | None = None
        self.rpc.register("ping", _ping)
        self.rpc.register("identify", self._identify)
        self.autonat = AutoNat(self)
        self.relay = Relay(self, config.relay)
        self.puncher = HolePuncher(self)
        self.portmap = PortMapper(self.endpoint)
        self.dht = create_dht(self)  # after autonat: "auto" mode reads its verdict
        self.docs = Replication(self, config.crdt)
        self.shards = Shards(self, config.shards)

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
        the listen address unless it is a wildcard, the NAT-PMP mapping, the
        public addresses STUN saw when our NAT's mapping does not depend on the
        destination, and the address an AutoNAT dial-back reached.  Never a
        relayed or virtual address.  On a wildcard listen address, the
        addresses direct peers saw us at with our own port stand in for it
        (no port translation on the way: a LAN or a public host)."""
        listen = self.listen_address
        found = [HostPort.parse(text) for text in self._observed] if listen.host in ("0.0.0.0", "::") else [listen]
        if self.portmap.mapped is not None:
            found.append(self.portmap.mapped)
        report = self.stun.mapping
        if report is not None and report.hole_punching_works:
            found += [HostPort(*address) for address in report.public_addresses]
        if self.autonat.status == "public" and self.autonat.address:
            found.append(HostPort.parse(self.autonat.address))
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
        conn.close(CLOSE_REPLACED, "replaced by another connection to the same peer")

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

    def talked_to_recently(self, address: tuple[str, int]) -> bool:
        """Whether we exchanged packets with ``address`` lately: a live or recent
        connection, or a STUN request we answered (its NAT would let us in)."""
        if self.stun.asked_recently(address):
            return True
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
        info = {"remote": _direct_address(conn), "path": conn.path}
        self._nursery.start_soon(self.rpc.server.serve_call, stream, conn.peer_id, info)

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
        addresses, then ``hints`` (HOST:PORT heard of elsewhere), then through
        relays, then (if ``find``) the addresses the DHT knows for it.

        Raises Unavailable when no address is known or none answers.
        """
        conn = self._live(peer)
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
        for relay in self._relays(record):
            try:
                return await self.connect_via(relay, peer)
            except RpcError as exc:
                label = f"via {relay.short()}"
                errors[label] = f"{label}: {exc.message}"
        if find:
            addrs = await self._dht_addresses(peer)  # the lookup itself may connect us to the peer
            conn = self._live(peer) or await self._dial_any(peer, addrs, errors)
            if conn is not None:
                return conn
        if not errors:
            raise Unavailable(f"no known address for {peer}; connect to PEERID@HOST:PORT first")
        raise Unavailable(f"could not reach {peer}: " + "; ".join(errors.values()))

    def _live(self, peer: PeerId) -> PeerConnection | None:
        conn = self._conns.get(peer)
        return conn if conn is not None and conn.close_reason is None else None

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

    async def _dht_addresses(self, peer: PeerId) -> tuple[str, ...]:
        """The addresses the DHT has for ``peer`` (asks the network)."""
        try:
            contact = await self.dht.find_peer(peer.key)
        except DhtError as exc:
            log.debug("DHT lookup of %s failed: %s", peer, exc)
            return ()
        return contact.addrs if contact is not None else ()

    def _relays(self, record: PeerRecord | None) -> list[PeerId]:
        """Connected relays that may carry a connection to the peer: those it
        advertised (identify), then our bootstrap peers."""
        advertised = []
        for text in record.relays if record else []:
            try:
                advertised.append(PeerId.from_string(text))
            except PeerIdError:
                continue
        bootstrap = [addr.peer_id for addr in self.bootstrap]
        return [peer for peer in dict.fromkeys(advertised + bootstrap) if peer in self._conns]

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
        conn = self._conns.get(addr.peer_id)
        if conn is None or conn.close_reason is not None:
            try:
                await self._dial(addr)
            except DialError as exc:
                raise Unavailable(str(exc)) from None
        self.peerstore.add_addresses(addr.peer_id, [str(addr.hostport)])
        return addr.peer_id

    async def connect_via(self, relay: PeerId, peer: PeerId) -> PeerConnection:
        """Reach ``peer`` through ``relay``, then try to punch a direct path in the background.

        Returns the relayed connection; if punching works, a direct one (path
        "punched") replaces it for later calls.
        """
        conn = await self.relay.dial_via(relay, peer)
        if self.config.nat.hole_punching:
            self._nursery.start_soon(self.puncher.punch, peer)
        return conn

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
        """One dict per connected peer: id, address, path, direction, RTT, open streams."""
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
        return await self.rpc.call(peer, "identify", None, timeout=timeout)

    async def _identify(self, arg: object, ctx) -> dict:
        remote = ctx.info.get("remote")
        return {
            "peer_id": str(self.peer_id),
            "listen": [str(self.listen_address)],
            "observed": _hostport(remote) if remote else None,
            "services": self.rpc.server.methods,
            "agent": AGENT,
            "protocol": "meshd/1",
            "relays": [str(relay) for relay in self.relay.status()["reserved_at"]],
        }

    def nat_status(self) -> dict:
        """What the node knows of its NAT situation so far."""
        report = self.stun.mapping
        return {
            "listen": str(self.listen_address),
            "reflexive": dict(self.stun.reflexive),
            "mapping": report.mapping.value if report else None,
            "port_preserved": report.port_preserved if report else None,
            "public_addresses": [str(HostPort(*a)) for a in report.public_addresses] if report else [],
            "stun_servers": list(self.config.nat.stun_servers),
            "stun_answered": self.endpoint.stats["stun_answered"],
            "port_mapping": self.portmap.status(),
            "reachability": self.autonat.status,
            "reachability_address": self.autonat.address,
            "reachability_via": self.autonat.via,
            "filtering": _FILTERING[self.autonat.status],
            "hairpinning": self.stun.hairpinning,
            "relay_reservations": self.relay.status()["reserved_at"],
        }

    def stun_servers(self) -> list[HostPort]:
        """Configured STUN servers, then every connected peer (each meshd is one)."""
        servers = list(self.configured_stun)
        servers += [HostPort.parse(_hostport(conn.remote_addr)) for conn in self._conns.values()
                    if _direct_address(conn) is not None]
        return list(dict.fromkeys(servers))

    def status(self) -> dict:
        return {
            "peer_id": str(self.peer_id),
            "address": str(self.address),
            "listen": str(self.listen_address),
            "agent": AGENT,
            "uptime_s": round(trio.current_time() - self.started_at, 1),
            "connections": len(self._conns),
            "known_peers": len(self.peerstore.all()),
            "services": self.rpc.server.methods,
            "data_dir": str(self.data_dir),
            "transport": dict(self.endpoint.stats),
            "documents": len(self.docs.replicas()),
        }

    # --- bootstrap -------------------------------------------------------------

    async def _keep_connected(self, addr: PeerAddr) -> None:
        """Stay connected to a bootstrap peer: dial with backoff, redial when lost."""
        delay = 0.25
        cap = self.config.peers.bootstrap_max_backoff
        while True:
            conn = self._conns.get(addr.peer_id)
            if conn is not None and conn.close_reason is None:
                delay = 0.25
                with trio.move_on_after(await self._reserve_at(addr.peer_id)):
                    await conn.terminated.wait()
                continue
            try:
                await self.connect(addr)
                continue
            except RpcError as exc:
                log.warning("bootstrap %s failed (retry in %.1f s): %s", addr.hostport, delay, exc)
            await trio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(cap, delay * 2)

    async def _reserve_at(self, relay: PeerId) -> float:
        """Reserve a relay slot at a bootstrap peer; seconds until it should be renewed."""
        if not self.config.relay.reserve_at_bootstrap:
            return math.inf
        try:
            limits = await self.relay.reserve(relay)
        except RpcError as exc:
            log.debug("no relay reservation at %s: %s", relay, exc)
            return math.inf
        return float(limits["ttl"]) * 0.8

    async def _watch_nat(self, stun_servers: list[HostPort]) -> None:
        """At start: classify the NAT, then keep the AutoNAT verdict current."""
        await self.stun.discover(stun_servers)
        await self.autonat.keep_checking()

    def close_idle(self, older_than: float) -> list[PeerId]:
        """Close connections that have had no stream for ``older_than`` seconds,
        except to peers this node depends on: bootstrap peers and relays in
        either direction.  Returns the peers closed."""
        now = trio.current_time()
        keep = {addr.peer_id for addr in self.bootstrap}
        keep.update(self.relay.reserved_at, self.relay.reservations)
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

    async def _run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            host_port = HostPort.parse(self.config.node.listen, allow_zero_port=True)
            await nursery.start(self.endpoint.serve, host_port.host, host_port.port)
            await nursery.start(serve_control, self)
            await nursery.start(run_dht, self)
            await nursery.start(self.docs.run)
            await nursery.start(self.shards.run)
            if self.config.nat.port_mapping and host_port.host == "0.0.0.0":
                nursery.start_soon(self.portmap.run)
            if self.configured_stun:
                nursery.start_soon(self._watch_nat, self.configured_stun)
            if self.config.transport.close_idle_after > 0:
                nursery.start_soon(self._close_idle_loop, self.config.transport.close_idle_after)
            for addr in self.bootstrap:
                if addr.peer_id == self.peer_id:
                    log.info("skipping bootstrap entry %s: it is this node", addr.hostport)
                    continue
                nursery.start_soon(self._keep_connected, addr)
            log.info("meshd %s listening at %s", __version__, self.address)
            task_status.started()

    def _close_connections(self) -> None:
        for conn in list(self._conns.values()):
            conn.close(reason="node shutting down")
        self._conns.clear()


async def _ping(arg: object, ctx) -> object:
    """Echo the argument: a liveness and round-trip check."""
    return arg


def _hostport(addr: tuple) -> str:
    return str(HostPort(*plain_address(addr)))


# What AutoNAT's third-party dial-back says about the NAT's filtering (RFC 4787 terms).
_FILTERING = {
    "public": "endpoint-independent (strangers reach us)",
    "private": "address-dependent or stricter",
    "unknown": None,
}


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


@asynccontextmanager
async def open_node(
    data_dir: str | Path,
    *,
    listen: str | list[str] | None = None,
    bootstrap: list[str] | None = None,
    config: Config | None = None,
) -> AsyncIterator[Node]:
    """Start a node with its state in ``data_dir``; stop it cleanly on exit.

    ``listen`` and ``bootstrap`` override the config file.  The identity key
    is created on first use.  Leaving the block closes every connection
    (peers are told), saves the DHT's routing table and flushes the peer
    store and the DHT database.
    """
    data_dir = Path(data_dir).expanduser()
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    config = config or Config.load(data_dir)
    if listen is not None:
        if isinstance(listen, list):
            if len(listen) != 1:
                raise ValueError(
                    "meshd listens on one UDP socket; use [::]:PORT for IPv4 and IPv6 together"
                )
            listen = listen[0]
        config.node.listen = listen
    if bootstrap is not None:
        config.node.bootstrap = list(bootstrap)
    node = Node(data_dir, config)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(node._run)
            try:
                yield node
            finally:
                node._close_connections()
                nursery.cancel_scope.cancel()
    finally:
        node.peerstore.close()
        node.dht.db.close()
        node.docs.store.close()
        node.shards.store.close()
