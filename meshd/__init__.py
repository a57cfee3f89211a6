"""meshd: a peer-to-peer mesh daemon for AI workloads.

The public surface: :func:`open_node` runs a node in-process, :func:`connect`
talks to a running daemon, and the RPC errors, identities and addresses they
use.
"""

from ._version import __version__
from .address import AddressError, HostPort, PeerAddr
from .config import Config, ConfigError
from .control import Client, DaemonNotRunning, connect
from .docclient import RemoteDocument, split_path
from .identity import Identity, IdentityError, PeerId, PeerIdError
from .node import Node, open_node
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

__all__ = [
    "AddressError", "CallContext", "Cancelled", "Client", "Config", "ConfigError",
    "DaemonNotRunning", "DeadlineExceeded", "FrameTooLargeError", "HostPort", "Identity",
    "IdentityError", "Internal", "InvalidArgument", "Node", "NotFound", "PeerAddr", "PeerId",
    "PeerIdError", "PermissionDenied", "ProtocolViolation", "RemoteDocument", "ResourceExhausted",
    "RpcError", "Unavailable", "UnknownMethod", "__version__", "connect", "open_node", "split_path",
]
