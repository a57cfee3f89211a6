"""The shard service's config section, ``[shards]``."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...lane import MAX_CHUNK, MAX_IDS


@dataclass
class ShardsSection:
    max_bytes: int = 1 << 40  # chunk store size; unpinned chunks are collected beyond it
    registry: str = ""  # document naming models (NAME or PEERID/NAME); "" = this node's "models"
    lane: bool = True  # serve and use the TCP bulk lane to peers with a direct path (QUIC otherwise)
    # bytes of one chunk the lane serves or takes (a larger one goes over QUIC)
    lane_max_chunk: int = field(default=MAX_CHUNK, metadata={"min": 64 << 10, "max": 64 << 20})
    lane_max_ids: int = field(default=MAX_IDS, metadata={"min": 1, "max": 4096})  # chunk ids in one lane request
