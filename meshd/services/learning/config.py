"""The ``[learning]`` config section: training groups' timing and limits."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LearningSection:
    heartbeat_interval: float = 2.0  # seconds between hellos to each member of a group
    discover_interval: float = 10.0  # seconds between provider lookups for a group's members
    join_wait: float = 30.0  # the first lookup waits up to this long for the DHT to join (else it finds nobody)
    max_members: int = 64  # members one group tracks (the first heard are kept)
    max_bytes: int = 8 << 30  # largest tensor set one peer may send in one call
    round_timeout_min: float = 5.0  # an exchange waits at least this long for a slow member
    round_timeout_max: float = 600.0  # ... and never longer than this
    lane: bool = True  # tensor payloads over the TCP bulk lane to peers with a direct path (QUIC otherwise)
    lane_min_bytes: int = 1 << 20  # ... if the set's payloads are this large: a smaller one goes faster over QUIC
    shard_sync_min_bytes: int = 64 << 20  # a whole state (θ and momentum) this large or more moves over shard sync
