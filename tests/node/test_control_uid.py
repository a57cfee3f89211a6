"""The control socket admits its own user and root only, even where file permissions would let
another user in.

The node runs in this process (as root, where this test can run at all); a forked child drops to
another uid and connects to the socket, whose directory and file the test opens to everyone, so
that the daemon's SO_PEERCRED check is the only thing in the way.  Root is needed to take another
uid: elsewhere the test skips.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import trio

import meshd
from meshd.control.socket import socket_path

NOBODY = 65534
CLOSED, ANSWERED, NO_ENTRY, FAILED = 0, 1, 2, 3


def _as_another_user(data_dir: Path, uid: int) -> int:
    """In a forked child: ask the node of ``data_dir`` for its status as ``uid``, and say
    whether it answered (ANSWERED), closed the connection (CLOSED), or the socket refused
    us at the file system (NO_ENTRY); the parent waits for the exit code.  Called from a
    worker thread, so the child has no trio run of its own until it starts one."""
    pid = os.fork()
    if pid == 0:  # the child: only this, then _exit
        code = FAILED
        try:
            os.setgid(uid)
            os.setuid(uid)
            code = trio.run(_ask_status, data_dir)
        except BaseException:  # noqa: BLE001  (the child must reach _exit whatever happened)
            code = FAILED
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


async def _ask_status(data_dir: Path) -> int:
    try:
        with trio.fail_after(10):
            async with meshd.connect(data_dir) as client:
                await client.status()
    except meshd.Unavailable as exc:  # the file system said no, or the daemon closed the connection
        return NO_ENTRY if "Permission denied" in str(exc) else CLOSED
    return ANSWERED


async def test_another_user_is_turned_away_by_its_uid_even_with_the_socket_open_to_all():
    if os.geteuid() != 0:
        pytest.skip("taking another uid needs root")
    base = Path(tempfile.mkdtemp(prefix="meshd-uid-"))  # not under pytest's 0700 tree: the child must reach it
    try:
        base.chmod(0o711)
        async with meshd.open_node(base / "node", listen="127.0.0.1:0"):
            (base / "node").chmod(0o711)
            path = socket_path(base / "node")
            assert path.stat().st_mode & 0o777 == 0o600  # as the daemon made it
            assert await trio.to_thread.run_sync(_as_another_user, base / "node", NOBODY) == NO_ENTRY
            path.chmod(0o666)  # now only the uid check stands between the stranger and the node
            assert await trio.to_thread.run_sync(_as_another_user, base / "node", NOBODY) == CLOSED
            assert await trio.to_thread.run_sync(_as_another_user, base / "node", 0) == ANSWERED  # root is let in
            async with meshd.connect(base / "node") as client:  # its own user (root) is served
                assert (await client.status())["peer_id"]
    finally:
        shutil.rmtree(base, ignore_errors=True)
