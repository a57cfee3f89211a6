"""QUIC transport: one UDP socket per node, authenticated peer connections, streams."""

from .connection import ALPN, PeerConnection, set_when_terminated
from .endpoint import DialError, Endpoint, TransportConfig
from .stream import QuicCallStream
from .tls import PeerAuthError

__all__ = [
    "ALPN", "DialError", "Endpoint", "PeerAuthError", "PeerConnection", "QuicCallStream",
    "TransportConfig", "set_when_terminated",
]
