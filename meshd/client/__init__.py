"""The client library: talk to a running daemon through its control socket.

::

    async with meshd.connect("~/.meshd") as client:
        print(await client.status())

:class:`Client` gathers one set of methods per capability, each in the module
of the same name as the service it calls (``nat``, ``dht``, ``crdt``,
``shards``, ``learning``, ``experts``) plus the node core's (``node``).  It imports no service and not
the node: only the control socket's location and the RPC frames, and trio on
the first call.  :mod:`.blocking` runs the same methods over a blocking socket
for callers with no event loop (``meshctl``).  :mod:`.training` (torch; not
imported here) is a training script's half of a DiLoCo or gossip session
the daemon runs for it (``meshd.learning.DiLoCo(client, model, ...)``).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

from ..control.socket import socket_path
from .base import ControlClient, DaemonNotRunning
from .crdt import CrdtMethods, RemoteDocument, split_path
from .dht import DhtMethods
from .experts import ExpertsMethods
from .learning import LearningMethods
from .metrics import MetricsMethods
from .nat import NatMethods
from .node import NodeMethods
from .shards import ShardsMethods


class Client(NodeMethods, NatMethods, DhtMethods, CrdtMethods, ShardsMethods, LearningMethods, ExpertsMethods,
             MetricsMethods):
    """Talks to a running daemon.  Get one with :func:`connect`; every method
    is one control call (see each capability's module for what they promise)."""


@asynccontextmanager
async def connect(data_dir: str | Path = "~/.meshd") -> AsyncIterator[Client]:
    """A client for the daemon running with ``data_dir``.

    Its calls share one connection, closed when the block is left.  Raises
    DaemonNotRunning at once if no daemon answers there.
    """
    client = Client(socket_path(data_dir))
    try:
        await client.id()
        yield client
    finally:
        await client.aclose()


__all__ = ["Client", "ControlClient", "DaemonNotRunning", "RemoteDocument", "connect", "split_path"]
