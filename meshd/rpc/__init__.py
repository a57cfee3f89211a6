"""RPC over streams: msgpack frames, unary and streaming calls, typed errors.

:class:`RpcServer` serves calls arriving on any stream (a peer's QUIC stream
or the control socket); :class:`PeerRpc` calls peers by PeerId over the one
connection to each; :mod:`meshd.rpc.args` checks request arguments.
"""

from .channel import Channel
from .client import ResponseStream, bidi_call, client_stream_call, unary_call
from .errors import (
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
from .peer import PeerRpc, RpcConfig
from .server import CallContext, RpcServer

__all__ = [
    "CallContext", "Cancelled", "Channel", "bidi_call", "DeadlineExceeded", "FrameTooLargeError", "Internal",
    "InvalidArgument", "NotFound", "PeerRpc", "RpcConfig", "PermissionDenied", "ProtocolViolation", "ResourceExhausted",
    "ResponseStream", "RpcError", "RpcServer", "Unavailable", "UnknownMethod",
    "client_stream_call", "unary_call",
]
