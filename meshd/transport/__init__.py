"""QUIC transport: one UDP socket per node, authenticated peer connections, streams."""

from .connection import ALPN, PeerConnection
from .endpoint import DialError, Endpoint, TransportConfig
from .stream import QuicCallStream
from .tls import PeerAuthError

__all__ = [
    "ALPN", "DialError", "Endpoint", "PeerAuthError", "PeerConnection", "QuicCallStream",
    "TransportConfig",
]
