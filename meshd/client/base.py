"""One call to the local daemon's control socket per request."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import TYPE_CHECKING

from ..control.socket import MAX_FRAME
from ..rpc.errors import Unavailable

if TYPE_CHECKING:
    from ..control.stream import SocketCallStream
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

    trio and the RPC call code are imported on the first call, not with this
    module: ``meshctl`` uses these methods through
    :class:`meshd.client.blocking.BlockingClient`, which needs neither.
    """

    def __init__(self, path: Path):
        self.path = path

    async def _open(self) -> SocketCallStream:
        import trio

        from ..control.stream import SocketCallStream

        try:
            return SocketCallStream(await trio.open_unix_socket(str(self.path)))
        except OSError as exc:
            raise open_error(self.path, exc) from None

    async def request(self, method: str, arg: object = None, timeout: float | None = 60) -> object:
        """Call a control method of the daemon."""
        from ..rpc.client import unary_call

        return await unary_call(self._open, method, arg, timeout, MAX_FRAME)

    def stream(self, method: str, arg: object = None) -> ResponseStream:
        """A server-streaming control method: ``async for item in client.stream(...)``."""
        from ..rpc.client import ResponseStream

        return ResponseStream(self._open, method, arg, None, MAX_FRAME)
