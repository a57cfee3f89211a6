"""The Prometheus HTTP exporter: prometheus-client's server in its own thread.

Each scrape asks the trio thread for one snapshot (``trio.from_thread.run_sync``
with the node's trio token) and formats it on the HTTP thread, so the figures
are never read while trio code changes them, and the node does nothing at all
between scrapes.  Process figures (``process_*``: memory, CPU, open files)
and the garbage collector's (``python_gc_*``: collections and objects by
generation) come from prometheus-client's own collectors, beside
``python_gc_frozen_objects``: what ``meshd start`` left out of every
collection once started (``gc.freeze``).
"""

from __future__ import annotations

import gc
import logging
from typing import Callable, Iterator

import trio
from prometheus_client import CollectorRegistry, GCCollector, Gauge, ProcessCollector, start_http_server
from prometheus_client.core import Metric

from ...address import HostPort
from .families import families

log = logging.getLogger("meshd.metrics")


class _Collector:
    """Collects by taking a snapshot on the trio thread."""

    def __init__(self, take: Callable[[], dict], token: trio.lowlevel.TrioToken):
        self._take = take
        self._token = token

    def collect(self) -> Iterator[Metric]:
        try:
            snapshot = trio.from_thread.run_sync(self._take, trio_token=self._token)
        except trio.RunFinishedError:  # a scrape while the node stopped: process figures only
            return
        yield from families(snapshot)


async def export(address: HostPort, take: Callable[[], dict], *,
                 task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``/metrics`` at ``address`` until cancelled; ``task_status.started``
    gets the HOST:PORT it listens at (the port chosen when ``address`` has port 0).

    RuntimeError, naming the key to change, if the address cannot be bound.
    """
    registry = CollectorRegistry()
    registry.register(_Collector(take, trio.lowlevel.current_trio_token()))
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    Gauge("python_gc_frozen_objects", "Objects the garbage collector never walks (gc.freeze)",
          registry=registry).set_function(gc.get_freeze_count)
    try:
        server, _thread = start_http_server(address.port, addr=address.host, registry=registry)
    except OSError as exc:
        raise RuntimeError(f"metrics: cannot listen on {address}: {exc.strerror or exc}; "
                           "pick another [metrics] listen") from None
    listening = str(HostPort(address.host, server.server_port))
    log.info("metrics at http://%s/metrics", listening)
    try:
        task_status.started(listening)
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):  # its loop notices within half a second
            await trio.to_thread.run_sync(server.shutdown)
        server.server_close()
