"""The byte-stream interface the RPC layer runs over.

A call runs over one :class:`CallStream`: a QUIC stream between peers
(:mod:`meshd.transport.stream`) or a Unix-socket connection to the local
daemon (:mod:`meshd.control.session`; blocking, for ``meshctl``:
:mod:`meshd.client.blocking`).  All give the RPC code the same semantics, so
one implementation serves the network and the control socket.  Nothing here
imports trio at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import trio


class StreamAborted(Exception):
    """The other side reset the stream, or the connection under it was lost."""


class StreamRefused(StreamAborted):
    """The peer closed the connection without having seen this stream.

    Nothing the stream carried was acted on, so a caller may send the same
    request again on another connection (HTTP/2's GOAWAY gives the same
    promise for streams above its last stream id).
    """


class CallStream(Protocol):
    async def send_all(self, data: bytes, eof: bool = False) -> None:
        """Queue ``data``, waiting while the peer is not keeping up.

        ``eof=True`` also ends our sending side after ``data``, in the same
        operation; we may go on reading.
        """

    async def receive_some(self) -> bytes:
        """The next bytes received; ``b""`` once the peer has finished sending.

        Raises StreamAborted if the peer reset the stream or the connection died.
        """

    async def close(self) -> None:
        """End our sending side after everything queued, and stop reading.

        In the RPC protocol this is each side's last act, so data the peer
        still sends is discarded (a QUIC peer is told to stop sending).
        """

    def abort(self) -> None:
        """Reset both directions at once; never blocks."""

    def cancel_on_abort(self, scope: trio.CancelScope | None) -> None:
        """Cancel ``scope`` if the peer abandons the stream (reset, stop-sending,
        or, where ``eof`` is ignored, an end of stream).

        ``None`` stops watching.  Used by the server while a handler runs.
        """
