"""Where the control socket is and how much one frame on it may carry.

Shared by the server (:mod:`meshd.control.server`) and the client library
(:mod:`meshd.client`), which must agree on both.
"""

from __future__ import annotations

from pathlib import Path

SOCKET_FILE = "meshd.sock"
MAX_FRAME = 16 << 20


def socket_path(data_dir: str | Path) -> Path:
    """The control socket of the daemon that runs with ``data_dir``."""
    return Path(data_dir).expanduser() / SOCKET_FILE
