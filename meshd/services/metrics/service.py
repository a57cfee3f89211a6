"""The metrics service: the node's figures for ``meshctl top`` and for Prometheus.

Recording the calls (:class:`meshd.rpc.stats.CallStats`) starts only when
something looks: the exporter is on (``[metrics] listen``), or a client asked
for a snapshot (``meshctl top``).  Before that the RPC layer pays one
``is None`` test per call.
"""

from __future__ import annotations

import time
from typing import Mapping

import trio

from ...rpc.stats import CallStats
from ...service import Host
from . import snapshot
from .config import MetricsSection
from .snapshot import Figures


class Metrics:
    """Snapshots of the node's figures (service ``metrics``, config ``[metrics]``).

    ``sources`` are the services with figures of their own, by name.  The
    config's address is checked here, so a bad one fails at start.
    """

    name = "metrics"

    def __init__(self, host: Host, config: MetricsSection, *, sources: Mapping[str, Figures]):
        self._host = host
        self._address = config.address()
        self._sources = dict(sources)
        self._calls: CallStats | None = None
        self._started = time.monotonic()  # the node starts with its services
        self.exporting: str | None = None  # HOST:PORT the exporter listens at

    def rpc_methods(self) -> dict:
        return {}

    def control_methods(self) -> dict:
        return {"metrics.snapshot": self._control_snapshot}

    def status(self) -> dict:
        return {"exporter": self.exporting or "off", "recording": self._calls is not None}

    def close(self) -> None:
        pass

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve the exporter, if configured, until cancelled."""
        if self._address is None:
            task_status.started()
            return
        from .exporter import export  # prometheus-client is loaded only when it is used

        self.record()
        async with trio.open_nursery() as nursery:
            self.exporting = await nursery.start(export, self._address, self.snapshot)
            task_status.started()

    def record(self) -> None:
        """Count every call served and made from now on (once; later calls do nothing)."""
        if self._calls is None:
            self._calls = CallStats()
            self._host.rpc.observe(self._calls)

    def snapshot(self) -> dict:
        """The node's figures now (see :func:`.snapshot.take`); on the trio thread."""
        return snapshot.take(self._host, self._calls, self._sources,
                             round(time.monotonic() - self._started, 3))

    async def _control_snapshot(self, arg: object, ctx) -> dict:
        """One snapshot; the first one starts the recording of calls."""
        self.record()
        return self.snapshot()
