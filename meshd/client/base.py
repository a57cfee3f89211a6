"""Calls to the local daemon's control socket: one connection per client, a stream per call."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import TYPE_CHECKING

from ..control.socket import MAX_FRAME
from ..rpc.errors import Unavailable

if TYPE_CHECKING:
    from ..control.session import MuxSession, MuxStream
    from ..rpc.channel import Channel
    from ..rpc.client import ResponseStream


class DaemonNotRunning(Exception):
    """No daemon answers on the data dir's control socket."""


def open_error(path: Path, exc: OSError) -> Exception:
    """What a caller sees when the control socket at ``path`` cannot be opened."""
    if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
        return DaemonNotRunning(
            f"no meshd is running with data dir {path.parent} "
            f"(start one with `meshd start --data-dir {path.parent}`)"
        )
    return Unavailable(f"control socket {path}: {exc.strerror or exc}")


class ControlClient:
    """Calls the control methods of the daemon whose socket is at ``path``.

    All the calls a client makes at the same time share one connection, each
    on its own stream (:mod:`meshd.control.mux`); it is opened by the first
    call and again after it was lost, and closed by :meth:`aclose` (or
    leaving :func:`meshd.connect`).  A client is used from one trio run at a
    time; in a new run it opens a new connection.

    trio and the RPC call code are imported on the first call, not with this
    module: ``meshctl`` uses these methods through
    :class:`meshd.client.blocking.BlockingClient`, which needs neither.
    """

    def __init__(self, path: Path):
        self.path = path
        self._session: MuxSession | None = None
        self._run: object = None  # the trio run the session belongs to
        self._opening: object = None  # a trio.Lock, so concurrent first calls share one connection

    async def _open(self) -> MuxStream:
        """A new stream to the daemon; DaemonNotRunning or Unavailable if there is none."""
        from ..streams import StreamAborted

        session = await self._connection()
        try:
            return await session.open_stream()
        except StreamAborted as exc:
            raise Unavailable(str(exc)) from None

    async def _connection(self) -> MuxSession:
        import trio

        from ..control.session import MuxSession

        run = trio.lowlevel.current_root_task()
        if self._run is not run:  # a new trio run: the old connection belonged to the old one
            self._forget()
            self._run, self._opening = run, trio.Lock()
        async with self._opening:
            if self._session is None or self._session.lost is not None:
                self._forget()
                try:
                    self._session = await MuxSession.connect(str(self.path))
                except OSError as exc:
                    raise open_error(self.path, exc) from None
        return self._session

    def _forget(self) -> None:
        if self._session is not None:
            self._session.discard()
            self._session = None

    async def aclose(self) -> None:
        """Close the connection; calls still running on it end with Unavailable."""
        if self._session is not None:
            session, self._session = self._session, None
            await session.aclose()

    async def request(self, method: str, arg: object = None, timeout: float | None = 60) -> object:
        """Call a control method of the daemon."""
        from ..rpc.client import unary_call

        return await unary_call(self._open, method, arg, timeout, MAX_FRAME)

    def stream(self, method: str, arg: object = None) -> ResponseStream:
        """A server-streaming control method: ``async for item in client.stream(...)``."""
        from ..rpc.client import ResponseStream

        return ResponseStream(self._open, method, arg, None, MAX_FRAME)

    async def open_channel(self, method: str, arg: object = None) -> tuple[Channel, MuxStream]:
        """Start a bidirectional control call that outlives any one ``async with`` block
        (a training session: :mod:`meshd.client.training`), and return its channel and
        stream.  The caller ends it: ``await channel.end()`` then ``await stream.close()``
        (the daemon's handler sees the end of the channel), or ``stream.abort()`` (the
        handler is cancelled).  No time limit: the call lasts until then, or until the
        connection is lost, which cancels the handler too."""
        from ..rpc import protocol
        from ..rpc.channel import Channel
        from ..rpc.framed import Framed, call_error
        from ..streams import StreamAborted
        from ..wire import FrameError

        stream = await self._open()
        framed = Framed(stream, MAX_FRAME)
        try:
            await framed.write(protocol.request_frame(method, None, protocol.BIDI, arg))
        except (StreamAborted, FrameError) as exc:
            stream.abort()
            raise call_error(exc) from None
        return Channel(framed, caller=True), stream
