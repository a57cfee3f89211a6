"""The NAT traversal service: STUN, AutoNAT, relays, hole punching, port mapping, LAN discovery.

It climbs the connection ladder of ``docs/architecture.md`` for the node: it
answers STUN on the node's socket and learns the NAT's behaviour, keeps an
AutoNAT verdict, holds relay reservations at the bootstrap peers, gives the
node a route through relays (then punches a direct path), maps a port on the
home gateway, finds peers on its LAN by multicast beacons, and adds what it
learned to the addresses the node advertises.
"""

from __future__ import annotations

import logging

import trio

from nat.autonat import FILTERING
from nat.relay import renew_after

from ...address import HostPort, PeerAddr, plain_address
from ...identity import PeerId, PeerIdError
from ...peerstore import PeerRecord
from ...rpc import RpcError
from ...service import Host
from ...transport import PeerConnection
from ...transport.endpoint import VIRTUAL_HOST
from .autonat import AutoNat
from .config import NatSection, RelaySection
from .control import control_methods
from .lan import LanDiscovery
from .portmap import PortMapper
from .punch import HolePuncher
from .relay import Relay
from .stun import NodeStun

log = logging.getLogger("meshd.nat")
RESERVE_RETRY = 5.0  # seconds before asking a relay that refused a reservation again


class Nat:
    """NAT traversal for one node (service ``nat``; config ``[nat]`` and ``[relay]``)."""

    name = "nat"

    def __init__(self, host: Host, config: NatSection, relay: RelaySection):
        self._host = host
        self.config = config
        self.configured_stun = [HostPort.parse(text) for text in config.stun_servers]
        self.stun = NodeStun(host.endpoint)
        self.autonat = AutoNat(host, self.stun, request_interval=config.autonat_interval)
        self.relay = Relay(host, relay)
        self.portmap = PortMapper(host.endpoint, config.port_mapping_protocols, config.port_mapping_lifetime)
        self.puncher = HolePuncher(host, self.stun, self.portmap, self.stun_servers,
                                   offer_local=config.host_candidates)
        self.lan = LanDiscovery(host, config.lan_interval)
        host.add_route(self)
        host.add_address_source(self._addresses)
        host.add_identify(lambda: {"relays": [str(r) for r in self.relay.live_reservations()]})
        host.protect(lambda: [*self.relay.reserved_at, *self.relay.reservations])

    # --- the Service shape ---------------------------------------------------------

    def rpc_methods(self) -> dict:
        return {**self.autonat.rpc_methods(), **self.relay.rpc_methods(), **self.puncher.rpc_methods()}

    def control_methods(self) -> dict:
        return control_methods(self)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Map a port, classify the NAT and keep the AutoNAT verdict, hold relay
        reservations at the bootstrap peers, find peers on the LAN; until cancelled."""
        async with trio.open_nursery() as nursery:
            if self.config.lan_discovery:
                nursery.start_soon(self.lan.run)
            if self.config.port_mapping and self._host.listen_address.host == "0.0.0.0":
                nursery.start_soon(self.portmap.run)
            if self.configured_stun:
                nursery.start_soon(self._watch_nat, self.configured_stun)
            if self.relay.config.reserve_at_bootstrap:
                for addr in self._host.bootstrap:
                    if addr.peer_id != self._host.peer_id:
                        nursery.start_soon(self._keep_reserved, addr.peer_id)
            task_status.started()

    def status(self) -> dict:
        return {"reachability": self.autonat.status,
                "relay_reservations": len(self.relay.live_reservations()),
                "serving_reservations": len(self.relay.reservations)}

    def figures(self) -> dict:
        """For the metrics service: the relay's reservations, circuits and bytes."""
        return self.relay.figures()

    def close(self) -> None:
        pass

    # --- what the node asks of us ----------------------------------------------------

    def _addresses(self) -> list[HostPort]:
        """Where strangers may dial us: the gateway's port mapping, the public addresses
        STUN saw when our NAT's mapping does not depend on the destination, and
        the address an AutoNAT dial-back reached."""
        found = [self.portmap.mapped] if self.portmap.mapped is not None else []
        report = self.stun.mapping
        if report is not None and report.hole_punching_works:
            found += [HostPort(*address) for address in report.public_addresses]
        if self.autonat.status == "public" and self.autonat.address:
            found.append(HostPort.parse(self.autonat.address))
        return found

    async def reach(self, peer: PeerId, record: PeerRecord | None,
                    errors: dict[str, str]) -> PeerConnection | None:
        """Through a connected relay: those the peer advertised, then our bootstrap peers."""
        for relay in self._relays(record):
            try:
                return await self.via(relay, peer)
            except RpcError as exc:
                label = f"via {relay.short()}"
                errors[label] = f"{label}: {exc.message}"
        return None

    async def via(self, relay: PeerId, peer: PeerId) -> PeerConnection:
        """Reach ``peer`` through ``relay``, then try to punch a direct path in the background.

        Returns the relayed connection; if punching works, a direct one (path
        "punched") replaces it for later calls.
        """
        conn = await self.relay.dial_via(relay, peer)
        if self.config.hole_punching:
            self._host.spawn(self.puncher.punch, peer)
        return conn

    def relay_addresses(self) -> list[str]:
        """``PEERID@HOST:PORT`` of each relay holding our reservation now, at the
        address our direct connection to it uses: what the DHT publishes, so that
        peers that never met us, and dial through other relays, find ours."""
        found = []
        for relay in self.relay.live_reservations():
            conn = self._host.live(relay)
            if conn is not None and conn.remote_addr[0] != VIRTUAL_HOST:
                found.append(str(PeerAddr(relay, HostPort(*plain_address(conn.remote_addr)))))
        return found

    def _relays(self, record: PeerRecord | None) -> list[PeerId]:
        advertised = []
        for text in record.relays if record else []:
            try:
                advertised.append(PeerId.from_string(text))
            except PeerIdError:
                continue
        bootstrap = [addr.peer_id for addr in self._host.bootstrap]
        return [peer for peer in dict.fromkeys(advertised + bootstrap) if self._host.live(peer) is not None]

    # --- background work -------------------------------------------------------------

    async def _watch_nat(self, stun_servers: list[HostPort]) -> None:
        """At start: classify the NAT, then keep the AutoNAT verdict current."""
        await self.stun.discover(stun_servers)
        await self.autonat.keep_checking()

    async def _keep_reserved(self, relay: PeerId) -> None:
        """Hold a relay reservation at a bootstrap peer whenever we are connected
        to it: reserve, renew before it lapses (``nat.relay.renew_after``), reserve
        again after a reconnect."""
        while True:
            await self._host.wait_connected(relay)
            conn = self._host.live(relay)
            if conn is None:
                continue
            with trio.move_on_after(await self._reserve_at(relay)):
                await conn.terminated.wait()

    async def _reserve_at(self, relay: PeerId) -> float:
        """Reserve a relay slot; seconds until it should be renewed, or tried again
        after a refusal (a relay not yet ready, or full, may take us later)."""
        try:
            limits = await self.relay.reserve(relay)
        except RpcError as exc:
            log.debug("no relay reservation at %s: %s", relay, exc)
            return RESERVE_RETRY
        return renew_after(limits["ttl"])

    # --- what meshctl shows ----------------------------------------------------------

    def stun_servers(self) -> list[HostPort]:
        """Configured STUN servers, then every directly connected peer (each meshd is one)."""
        servers = list(self.configured_stun)
        for peer in self._host.connected():
            conn = self._host.live(peer)
            if conn is not None and conn.remote_addr[0] != VIRTUAL_HOST:
                servers.append(HostPort(*plain_address(conn.remote_addr)))
        return list(dict.fromkeys(servers))

    def nat_status(self) -> dict:
        """What the node knows of its NAT situation so far."""
        report = self.stun.mapping
        return {
            "listen": str(self._host.listen_address),
            "reflexive": dict(self.stun.reflexive),
            "mapping": report.mapping.value if report else None,
            "port_preserved": report.port_preserved if report else None,
            "public_addresses": [str(HostPort(*a)) for a in report.public_addresses] if report else [],
            "stun_servers": list(self.config.stun_servers),
            "stun_answered": self._host.endpoint.stats["stun_answered"],
            "port_mapping": self.portmap.status(),
            "reachability": self.autonat.status,
            "reachability_address": self.autonat.address,
            "reachability_via": self.autonat.via,
            "filtering": FILTERING[self.autonat.status],
            "hairpinning": self.stun.hairpinning,
            "relay_reservations": self.relay.status()["reserved_at"],
            "host_candidates": self.puncher.local_addresses(),
            "lan_discovery": self.lan.status() if self.config.lan_discovery else "off",
        }
