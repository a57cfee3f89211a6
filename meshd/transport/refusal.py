"""A refusal that costs no handshake: one Initial packet carrying CONNECTION_CLOSE.

A server at a connection limit answers a dialer's first Initial without
building a connection or running TLS (RFC 9000 section 10.2.3 lets a
CONNECTION_CLOSE of type 0x1c ride in an Initial packet).  The packet is
protected with the Initial keys, which anyone derives from the destination
connection ID the dialer chose (RFC 9001 section 5.2), so building it costs a
key derivation and one AEAD seal, not an X25519 exchange and a signature.
It is far smaller than the 1,200-byte datagram that asked for it, so it
amplifies nothing.
"""

from __future__ import annotations

import os

from aioquic.quic.crypto import CryptoPair
from aioquic.quic.packet import QuicErrorCode, QuicFrameType, QuicPacketType
from aioquic.quic.packet_builder import QuicPacketBuilder

MAX_REASON = 100  # bytes of reason phrase sent at most


def refusal(header, reason: str) -> bytes:
    """The datagram that refuses the connection ``header`` (a client's Initial) opens:
    CONNECTION_CLOSE with CONNECTION_REFUSED and ``reason``, for the dialer to report."""
    crypto = CryptoPair()
    crypto.setup_initial(cid=header.destination_cid, is_client=False, version=header.version)
    builder = QuicPacketBuilder(host_cid=os.urandom(8), peer_cid=header.source_cid, version=header.version,
                                is_client=False, max_datagram_size=1200)
    builder.start_packet(QuicPacketType.INITIAL, crypto)
    phrase = reason.encode()[:MAX_REASON]
    buf = builder.start_frame(QuicFrameType.TRANSPORT_CLOSE, capacity=16 + len(phrase))
    buf.push_uint_var(QuicErrorCode.CONNECTION_REFUSED)
    buf.push_uint_var(0)  # the frame type that caused it: none
    buf.push_uint_var(len(phrase))
    buf.push_bytes(phrase)
    datagrams, _ = builder.flush()
    return b"".join(datagrams)
