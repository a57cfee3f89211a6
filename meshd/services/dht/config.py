"""The DHT service's config section, ``[dht]``: the library's knobs a user may turn."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dht.node import DhtConfig

_DHT = DhtConfig()


def _bounded(default, low, high=None):
    """A key's field with the bounds CoreConfig.update checks (``low`` to ``high``, inclusive)."""
    return field(default=default, metadata={"min": low} if high is None else {"min": low, "max": high})


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
    # Limits on what peers may make this node hold or do (docs/security.md):
    # PUT_VALUE records and ADD_PROVIDER keys one peer may send per second, and at once
    peer_rate: float = field(default=_DHT.peer_rate, metadata={"above": 0})
    peer_burst: int = _bounded(_DHT.peer_burst, 1)
    max_per_prefix: int = _bounded(_DHT.max_per_prefix, 1)  # contacts a bucket takes from one IP prefix
    ipv4_prefix: int = _bounded(_DHT.ipv4_prefix, 1, 32)  # bits of that prefix for IPv4 (a /24)
    ipv6_prefix: int = _bounded(_DHT.ipv6_prefix, 1, 128)  # ... and for IPv6 (a /48)
    check_after: float = _bounded(_DHT.check_after, 0.0)  # a full bucket pings its oldest if silent this long
    max_records: int = _bounded(_DHT.max_records, 1)  # records held for others (the farthest evicted)
    max_record_bytes: int = _bounded(_DHT.max_record_bytes, 64 << 10)  # ... and their bytes
    max_records_per_author: int = _bounded(_DHT.max_records_per_author, 1)
    max_providers_per_key: int = _bounded(_DHT.max_providers_per_key, 1)
    max_provider_keys: int = _bounded(_DHT.max_provider_keys, 1)  # keys with providers held
    max_providers: int = _bounded(_DHT.max_providers, 1)  # provider entries held in all
    # keys, ids or records accepted in one request (sent: at most 16, or this if fewer)
    max_request_items: int = _bounded(_DHT.max_request_items, 1, 256)
    # seconds between looks at our relay reservations; a change is published in the DHT
    relays_check: float = field(default=30.0, metadata={"above": 0})

    def dht_config(self) -> DhtConfig:
        """The library's config: these keys, its defaults for the rest."""
        keys = {f.name for f in dataclasses.fields(DhtConfig)}
        return DhtConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in keys})
