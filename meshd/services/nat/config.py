"""The NAT traversal service's config sections, ``[nat]`` and ``[relay]``."""

from __future__ import annotations

from dataclasses import dataclass, field

from nat.autonat import REQUEST_INTERVAL


@dataclass
class NatSection:
    stun_servers: list[str] = field(default_factory=list)  # HOST:PORT, asked at start
    hole_punching: bool = True  # after a relayed connection, try for a direct one
    port_mapping: bool = True  # ask the default gateway for a port, when listening on 0.0.0.0
    # tried in this order; "pcp" falls back to "natpmp" (same port) when both are listed
    port_mapping_protocols: list[str] = field(default_factory=lambda: ["pcp", "natpmp", "upnp"])
    port_mapping_lifetime: int = 7200  # seconds asked for; renewed at half what the gateway grants
    host_candidates: bool = True  # offer our interface addresses when punching (peers at one site)
    lan_discovery: bool = True  # multicast beacons on private-network interfaces: find LAN peers
    lan_interval: float = 30.0  # seconds between LAN beacons after the first few
    # seconds between the AutoNAT requests (dial-backs arranged) this node serves for one peer
    autonat_interval: float = field(default=REQUEST_INTERVAL, metadata={"above": 0, "max": 86400.0})


@dataclass
class RelaySection:
    enabled: bool = False  # carry circuits for NATed peers that reserve here
    max_reservations: int = 128
    # bytes per second all circuits carry together, both ways (32 MiB/s); beyond, they wait their turn. 0: no limit
    rate: float = field(default=32 << 20, metadata={"min": 0, "max": 1e12})
    reservation_ttl: float = 3600.0
    max_circuits: int = 16  # per reservation, at once
    circuit_bytes: int = 128 << 20  # both directions, per circuit
    circuit_seconds: float = 600.0
    reserve_at_bootstrap: bool = True  # ask bootstrap peers to relay for us (renewed before expiry)
