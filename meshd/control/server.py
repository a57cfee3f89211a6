"""The control socket's server: ``DATA_DIR/meshd.sock``.

The node hands it every method by name (its own and its services'), so this
module knows neither the node nor any service.  A connection carries many
calls at once, one per stream (:mod:`.mux`); each call uses the same RPC
frames as peers do.  Only this user (or root) may connect.
"""

from __future__ import annotations

import math
import os
import socket
import struct
from pathlib import Path
from typing import Callable, Mapping

import trio

from ..rpc import RpcServer
from .session import MuxSession
from .socket import MAX_FRAME, socket_path


def control_server(methods: Mapping[str, Callable],
                   unknown: Callable[[str], Exception | None] | None = None) -> RpcServer:
    """An RPC server offering ``methods``; ``unknown(name)`` may explain a
    method that is not offered (a service that is off).

    A handler's kind is inferred (unary, or server streaming for an async
    generator) unless it comes with one: anything with ``handler`` and
    ``kind`` attributes (``meshd.service.Method``: ``"bidi"``,
    ``"client_stream"``).  Calls have no server-side time cap: every caller
    is this user, and a call ends when its connection does (a training
    session, ``learning.session``, is one call for the whole run)."""
    server = RpcServer(max_frame=MAX_FRAME, max_calls_per_peer=64, explain_unknown=unknown,
                       max_call_timeout=math.inf)
    for name, handler in methods.items():
        kind = getattr(handler, "kind", None)
        server.register(name, getattr(handler, "handler", handler) if kind else handler, kind=kind)
    return server


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


async def serve_control(data_dir: Path, server: RpcServer, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Listen on the control socket of ``data_dir`` until cancelled; remove it afterwards.

    Raises RuntimeError if another daemon already answers there.
    """
    path = socket_path(data_dir)
    if path.exists():
        if await _answers(path):
            raise RuntimeError(f"another meshd is running with data dir {data_dir}; "
                               "stop it first, or use another --data-dir")
        path.unlink()
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(64)
    my_uid = os.getuid()
    try:
        async with trio.SocketListener(sock) as listener, trio.open_nursery() as nursery:
            task_status.started()
            while True:
                stream = await listener.accept()
                if _peer_uid(stream.socket) not in (my_uid, 0):
                    await stream.aclose()
                    continue
                session = MuxSession.accepted(stream)
                nursery.start_soon(session.serve, lambda call: server.serve_call(call, "control"))
    finally:
        path.unlink(missing_ok=True)


async def _answers(path: Path) -> bool:
    try:
        stream = await trio.open_unix_socket(str(path))
    except OSError:
        return False
    await stream.aclose()
    return True
