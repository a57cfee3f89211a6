"""The ``[experts]`` config section: serving limits and calling defaults."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExpertsSection:
    max_request_bytes: int = 64 << 20  # tensor bytes one call may carry, in and out
    max_tensors: int = 16  # tensors one call may carry
    max_queue: int = 256  # calls waiting for one expert before new ones are refused (RESOURCE_EXHAUSTED)
    max_queue_per_peer: int = 64  # ... of them from one peer
    call_timeout: float = 30.0  # how long a caller waits for an answer, and a call waits in a queue
    refresh_interval: float = 30.0  # seconds before a caller looks up an expert's servers again
    registry: str = ""  # document listing experts (NAME or PEERID/NAME); "" = this node's "experts"
    heartbeat: float = 300.0  # seconds between a server's registry refreshes (alive, and its load);
    #                           an entry not refreshed for 3 heartbeats is listed as stale
