"""The control plane: a Unix socket in the data dir that ``meshctl`` and the
client library call (mode 0600, and the connecting uid is checked).

The server offers the node core's methods and mounts each service's
``control_methods()``; it imports no service.  A connection carries many
calls, one per stream (:mod:`.mux`, sans-IO; :mod:`.session`, its trio shell).  The client side is
:mod:`meshd.client`.  Names load on first use (:mod:`meshd._lazy`), so a
client reading :mod:`.socket` does not import the server (nor trio).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".server": ["serve_control"],
    ".socket": ["MAX_FRAME", "SOCKET_FILE", "socket_path"],
})

if TYPE_CHECKING:
    from .server import serve_control
    from .socket import MAX_FRAME, SOCKET_FILE, socket_path
