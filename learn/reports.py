"""What a training round did, as the algorithms report it (in process, or from a daemon to its script)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SyncReport:
    """What one DiLoCo outer exchange (one fragment of one round) did."""

    round: int
    fragment: int
    contributors: int
    missing_values: int  # values no reducer delivered (their Δ was taken as 0)
    bytes_out: int  # to other members
    seconds: float


@dataclass
class GossipReport:
    """What one gossip round did."""

    round: int
    partners: int  # asked
    merged: int  # answered in time and merged
    bytes_in: int
    seconds: float
