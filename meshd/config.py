"""Node configuration: ``config.toml`` in the data directory, every key defaulted.

Sections mirror the dataclasses below.  Unknown sections or keys, values of
the wrong type, and values outside a key's choices are errors that name the
key, so a typo is never silently ignored.  ``render`` writes every key with
its value, which is what ``meshd init`` puts on disk.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from dht.node import DhtConfig

from .transport import TransportConfig

CONFIG_FILE = "config.toml"


class ConfigError(ValueError):
    """The configuration file or an override is invalid; the message names the key."""


@dataclass
class NodeConfig:
    listen: str = "0.0.0.0:4100"  # one UDP socket; "[::]:PORT" for IPv4 and IPv6
    bootstrap: list[str] = field(default_factory=list)  # PEERID@HOST:PORT
    log_level: str = "info"


@dataclass
class RpcConfig:
    max_frame: int = 16 << 20
    max_calls_per_peer: int = 256
    default_timeout: float = 30.0


@dataclass
class PeersConfig:
    bootstrap_max_backoff: float = 30.0
    max_addresses_per_peer: int = 8


@dataclass
class NatConfig:
    stun_servers: list[str] = field(default_factory=list)  # HOST:PORT, asked at start
    hole_punching: bool = True  # after a relayed connection, try for a direct one
    port_mapping: bool = True  # NAT-PMP on the default gateway, when listening on 0.0.0.0


@dataclass
class RelayConfig:
    enabled: bool = False  # carry circuits for NATed peers that reserve here
    max_reservations: int = 128
    reservation_ttl: float = 3600.0
    max_circuits: int = 16  # per reservation, at once
    circuit_bytes: int = 128 << 20  # both directions, per circuit
    circuit_seconds: float = 600.0
    reserve_at_bootstrap: bool = True  # ask bootstrap peers to relay for us (renewed before expiry)


_DHT = DhtConfig()


@dataclass
class DhtSection:
    # "auto": a DHT server (stores records, answers lookups) unless AutoNAT finds the
    # node unreachable; "server" or "client" fix the role.
    mode: str = field(default="auto", metadata={"choices": ("auto", "server", "client")})
    k: int = _DHT.k  # bucket size and replication factor
    alpha: int = _DHT.alpha  # queries in flight per lookup
    request_timeout: float = _DHT.request_timeout
    get_quorum: int = _DHT.get_quorum  # a get stops after this many replicas answered
    put_quorum: int = _DHT.put_quorum  # a put returns once this many stored the record
    record_ttl: float = _DHT.record_ttl
    provider_ttl: float = _DHT.provider_ttl
    provider_republish: float = _DHT.provider_republish

    def dht_config(self) -> DhtConfig:
        """The library's config: these keys, its defaults for the rest."""
        keys = {f.name for f in dataclasses.fields(DhtConfig)}
        return DhtConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in keys})


@dataclass
class CrdtSection:
    sync_interval: float = 10.0  # seconds between anti-entropy syncs of each document
    discover_interval: float = 60.0  # seconds between provider lookups for a document's replicas
    max_peers: int = 16  # replicas a document syncs and pushes with
    join_timeout: float = 10.0  # seconds opening another node's document waits for a first sync
    compact_every: int = 10_000  # changes between snapshots of a document
    max_pending: int = 10_000  # early changes held per document while their dependencies arrive
    peer_rate: float = 2000.0  # new changes per second one peer may send (each costs a signature check)
    peer_burst: int = 20_000  # ... and at once, e.g. a whole document to a new replica


@dataclass
class ShardsSection:
    max_bytes: int = 1 << 40  # chunk store size; unpinned chunks are collected beyond it
    registry: str = ""  # document naming models (NAME or PEERID/NAME); "" = this node's "models"
    lane: bool = True  # serve and use the TCP bulk lane to peers with a direct path (QUIC otherwise)


@dataclass
class Config:
    node: NodeConfig = field(default_factory=NodeConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    rpc: RpcConfig = field(default_factory=RpcConfig)
    peers: PeersConfig = field(default_factory=PeersConfig)
    nat: NatConfig = field(default_factory=NatConfig)
    relay: RelayConfig = field(default_factory=RelayConfig)
    dht: DhtSection = field(default_factory=DhtSection)
    crdt: CrdtSection = field(default_factory=CrdtSection)
    shards: ShardsSection = field(default_factory=ShardsSection)

    @classmethod
    def load(cls, data_dir: Path) -> "Config":
        """The config in ``data_dir`` (defaults for whatever it leaves out)."""
        path = data_dir / CONFIG_FILE
        config = cls()
        if path.exists():
            try:
                raw = tomllib.loads(path.read_text())
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"{path}: {exc}") from None
            config.update(raw, source=str(path))
        return config

    def update(self, raw: dict, source: str = "override") -> None:
        """Apply ``{section: {key: value}}``, checking every name and type."""
        for section_name, values in raw.items():
            section = getattr(self, section_name, None)
            if not dataclasses.is_dataclass(section) or not isinstance(values, dict):
                raise ConfigError(f"{source}: unknown section [{section_name}]")
            fields = {f.name: f for f in dataclasses.fields(section)}
            for key, value in values.items():
                if key not in fields:
                    raise ConfigError(f"{source}: unknown key {section_name}.{key}")
                name = f"{section_name}.{key}"
                value = _checked(value, getattr(section, key), name, source)
                choices = fields[key].metadata.get("choices")
                if choices and value not in choices:
                    raise ConfigError(f"{source}: {name} must be one of {', '.join(choices)}, not {value!r}")
                setattr(section, key, value)

    def render(self) -> str:
        """TOML text with every section and key written out."""
        lines = ["# meshd configuration: every key with its default; edit and restart.", ""]
        for f in dataclasses.fields(self):
            lines.append(f"[{f.name}]")
            section = getattr(self, f.name)
            for key, value in dataclasses.asdict(section).items():
                lines.append(f"{key} = {_toml_value(value)}")
            lines.append("")
        return "\n".join(lines)


def _checked(value: object, default: object, name: str, source: str) -> object:
    expected = type(default)
    if expected is float and type(value) is int:
        return float(value)
    if expected is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{source}: {name} must be a list of strings")
        return value
    if type(value) is not expected:
        raise ConfigError(f"{source}: {name} must be {expected.__name__}, not {type(value).__name__}")
    return value


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)
