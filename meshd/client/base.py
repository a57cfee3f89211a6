"""One call to the local daemon's control socket per request."""

from __future__ import annotations

import errno
from pathlib import Path

import trio

from ..rpc import ResponseStream, Unavailable, unary_call
from ..streams import SocketCallStream
from ..control.socket import MAX_FRAME


class DaemonNotRunning(Exception):
    """No daemon answers on the data dir's control socket."""


class ControlClient:
    """Calls the control methods of the daemon whose socket is at ``path``."""

    def __init__(self, path: Path):
        self.path = path

    async def _open(self) -> SocketCallStream:
        try:
            return SocketCallStream(await trio.open_unix_socket(str(self.path)))
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
                raise DaemonNotRunning(
                    f"no meshd is running with data dir {self.path.parent} "
                    f"(start one with `meshd start --data-dir {self.path.parent}`)"
                ) from None
            raise Unavailable(f"control socket {self.path}: {exc.strerror}") from None

    async def request(self, method: str, arg: object = None, timeout: float | None = 60) -> object:
        """Call a control method of the daemon."""
        return await unary_call(self._open, method, arg, timeout, MAX_FRAME)

    def stream(self, method: str, arg: object = None) -> ResponseStream:
        """A server-streaming control method: ``async for item in client.stream(...)``."""
        return ResponseStream(self._open, method, arg, None, MAX_FRAME)
