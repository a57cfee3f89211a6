"""meshd: a peer-to-peer mesh daemon for AI workloads.

The layout (``docs/architecture.md`` has the picture and the rules):

* the node core: :mod:`.node` (connections, identify, bootstrap), :mod:`.transport`
  (QUIC on one UDP socket), :mod:`.rpc`, :mod:`.identity`, :mod:`.address`,
  :mod:`.peerstore`, :mod:`.config`, :mod:`.control` (the local socket's server);
* :mod:`.service`: what a service is and all it sees of the node;
* :mod:`.services`: one subpackage per capability (nat, dht, crdt, shards);
* :mod:`.daemon`: the composition root, which builds a node and its services;
* :mod:`.client`: the client library for a running daemon;
* :mod:`.testing`: real daemons as child processes, for tests, benchmarks and the demo.

The public surface: :func:`open_node` runs a node in-process, :func:`connect`
talks to a running daemon, and the RPC errors, identities and addresses they use.
Each name is imported from its module on first use (:mod:`._lazy`), so
``meshd.connect`` loads the client, not the daemon, QUIC or the services.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports
from ._version import __version__

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".address": ["AddressError", "HostPort", "PeerAddr"],
    ".client": ["Client", "DaemonNotRunning", "RemoteDocument", "connect"],
    ".config": ["ConfigError"],
    ".daemon": ["SERVICES", "Config", "open_node"],
    ".identity": ["Identity", "IdentityError", "PeerId", "PeerIdError"],
    ".node": ["Node", "ServiceOff"],
    ".rpc": [
        "CallContext", "Cancelled", "DeadlineExceeded", "FrameTooLargeError", "Internal",
        "InvalidArgument", "NotFound", "PermissionDenied", "ProtocolViolation", "ResourceExhausted",
        "RpcError", "Unavailable", "UnknownMethod",
    ],
    ".service": ["Host", "Service"],
})
__all__ += ["__version__"]

if TYPE_CHECKING:
    from .address import AddressError, HostPort, PeerAddr
    from .client import Client, DaemonNotRunning, RemoteDocument, connect
    from .config import ConfigError
    from .daemon import SERVICES, Config, open_node
    from .identity import Identity, IdentityError, PeerId, PeerIdError
    from .node import Node, ServiceOff
    from .rpc import (
        CallContext,
        Cancelled,
        DeadlineExceeded,
        FrameTooLargeError,
        Internal,
        InvalidArgument,
        NotFound,
        PermissionDenied,
        ProtocolViolation,
        ResourceExhausted,
        RpcError,
        Unavailable,
        UnknownMethod,
    )
    from .service import Host, Service
