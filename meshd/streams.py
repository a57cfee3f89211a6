"""The byte-stream interface the RPC layer runs over, and its Unix-socket form.

A call runs over one :class:`CallStream`: a QUIC stream between peers
(:mod:`meshd.transport.stream`) or a Unix-socket connection to the local
daemon (:class:`SocketCallStream`).  Both give the RPC code the same
semantics, so one implementation serves the network and the control socket.
"""

from __future__ import annotations

from typing import Protocol

import trio


class StreamAborted(Exception):
    """The other side reset the stream, or the connection under it was lost."""


class CallStream(Protocol):
    async def send_all(self, data: bytes, eof: bool = False) -> None:
        """Queue ``data``, waiting while the peer is not keeping up.

        ``eof=True`` also ends our sending side after ``data``, in the same
        operation; we may go on reading.  A transport that cannot tell an end
        of sending from a disconnect (a Unix socket) keeps its side open and
        ends it at ``close``.
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


class SocketCallStream:
    """A CallStream over a trio SocketStream (the control socket).

    ``cancel_on_abort`` needs a task that reads the socket, so the stream is
    given a nursery to start it in.
    """

    def __init__(self, sock: trio.SocketStream, nursery: trio.Nursery | None = None):
        self._sock = sock
        self._nursery = nursery
        self._watch: trio.CancelScope | None = None

    async def send_all(self, data: bytes, eof: bool = False) -> None:
        # eof is ignored: on this socket an end of stream means the caller is gone
        try:
            await self._sock.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise StreamAborted(str(exc)) from None

    async def receive_some(self) -> bytes:
        try:
            return await self._sock.receive_some(1 << 16)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise StreamAborted(str(exc)) from None

    async def close(self) -> None:
        self.abort()

    def abort(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        self._sock.socket.close()

    def cancel_on_abort(self, scope: trio.CancelScope | None) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if scope is not None and self._nursery is not None:
            self._watch = trio.CancelScope()
            self._nursery.start_soon(self._watch_eof, self._watch, scope)

    async def _watch_eof(self, watch: trio.CancelScope, scope: trio.CancelScope) -> None:
        with watch:
            try:
                await self._sock.receive_some(1)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            scope.cancel()
