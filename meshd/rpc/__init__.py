"""RPC over streams: msgpack frames, unary and streaming calls, typed errors."""

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
from .server import CallContext, RpcServer

__all__ = [
    "CallContext", "Cancelled", "Channel", "bidi_call", "DeadlineExceeded", "FrameTooLargeError", "Internal",
    "InvalidArgument", "NotFound", "PermissionDenied", "ProtocolViolation", "ResourceExhausted",
    "ResponseStream", "RpcError", "RpcServer", "Unavailable", "UnknownMethod",
    "client_stream_call", "unary_call",
]
