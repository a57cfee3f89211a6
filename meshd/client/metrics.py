"""The client's methods for the node's figures (the ``metrics`` service)."""

from __future__ import annotations

from .base import ControlClient


class MetricsMethods(ControlClient):
    async def metrics(self) -> dict:
        """One snapshot of the node's figures: connections by path, calls and bytes by
        method and service, and the figures of each service (docs/operations.md).

        The first snapshot starts the daemon's recording of calls, so call tables
        fill from then on (at once if the Prometheus exporter is on).
        """
        return await self.request("metrics.snapshot")
