"""The control socket's CallStream: one trio SocketStream per call.

The server (:mod:`.server`) and the async client (:mod:`meshd.client`) both
run the RPC code over it.
"""

from __future__ import annotations

import trio

from ..streams import StreamAborted


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
