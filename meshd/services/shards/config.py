"""The shard service's config section, ``[shards]``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ShardsSection:
    max_bytes: int = 1 << 40  # chunk store size; unpinned chunks are collected beyond it
    registry: str = ""  # document naming models (NAME or PEERID/NAME); "" = this node's "models"
    lane: bool = True  # serve and use the TCP bulk lane to peers with a direct path (QUIC otherwise)
