"""The DHT service's config section, ``[dht]``: the library's knobs a user may turn."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dht.node import DhtConfig

_DHT = DhtConfig()


@dataclass
class DhtSection:
    # "auto": a DHT server (stores records, answers lookups) unless AutoNAT finds the
    # node unreachable; "server" or "client" fix the role.
    mode: str = field(default="auto", metadata={"choices": ("auto", "server", "client")})
    k: int = _DHT.k  # bucket size and replication factor
    alpha: int = _DHT.alpha  # queries in flight per lookup
    request_timeout: float = _DHT.request_timeout
    slow_factor: float = _DHT.slow_factor  # a lookup asks the next contact too after this many typical answers
    min_slow: float = _DHT.min_slow  # ... but not sooner than this many seconds
    get_quorum: int = _DHT.get_quorum  # a get stops after this many replicas answered
    put_quorum: int = _DHT.put_quorum  # a put returns once this many stored the record
    record_ttl: float = _DHT.record_ttl
    provider_ttl: float = _DHT.provider_ttl
    provider_republish: float = _DHT.provider_republish

    def dht_config(self) -> DhtConfig:
        """The library's config: these keys, its defaults for the rest."""
        keys = {f.name for f in dataclasses.fields(DhtConfig)}
        return DhtConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in keys})
