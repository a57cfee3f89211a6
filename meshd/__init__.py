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
"""

from ._version import __version__
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

__all__ = [
    "AddressError", "CallContext", "Cancelled", "Client", "Config", "ConfigError",
    "DaemonNotRunning", "DeadlineExceeded", "FrameTooLargeError", "Host", "HostPort", "Identity",
    "IdentityError", "Internal", "InvalidArgument", "Node", "NotFound", "PeerAddr", "PeerId",
    "PeerIdError", "PermissionDenied", "ProtocolViolation", "RemoteDocument", "ResourceExhausted",
    "RpcError", "SERVICES", "Service", "ServiceOff", "Unavailable", "UnknownMethod", "__version__",
    "connect", "open_node",
]
