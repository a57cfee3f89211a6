"""The control plane: a Unix socket in the data dir that ``meshctl`` and the
client library call (mode 0600, and the connecting uid is checked).

The server offers the node core's methods and mounts each service's
``control_methods()``; it imports no service.  The client side is
:mod:`meshd.client`.
"""

from .server import serve_control
from .socket import MAX_FRAME, SOCKET_FILE, socket_path

__all__ = ["MAX_FRAME", "SOCKET_FILE", "serve_control", "socket_path"]
