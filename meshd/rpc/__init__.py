"""RPC over streams: msgpack frames, unary and streaming calls, typed errors.

:class:`RpcServer` serves calls arriving on any stream (a peer's QUIC stream
or the control socket); :class:`PeerRpc` calls peers by PeerId over the one
connection to each; :mod:`meshd.rpc.args` checks request arguments.

Names load on first use (:mod:`meshd._lazy`): the frames (:mod:`.protocol`,
:mod:`.framed`) and :mod:`.errors` import neither trio nor the identities,
which ``meshctl``'s blocking client relies on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".channel": ["Channel"],
    ".client": ["ResponseStream", "bidi_call", "client_stream_call", "unary_call"],
    ".errors": [
        "Cancelled", "DeadlineExceeded", "FrameTooLargeError", "Internal", "InvalidArgument",
        "NotFound", "PermissionDenied", "ProtocolViolation", "ResourceExhausted", "RpcError",
        "Unavailable", "UnknownMethod",
    ],
    ".peer": ["PeerRpc", "RpcConfig"],
    ".server": ["CallContext", "RpcServer"],
})

if TYPE_CHECKING:
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
