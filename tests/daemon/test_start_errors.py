"""A ``meshd start`` that cannot start says why and what to do, in one line.

Each case runs the real daemon (``python -m cli.meshd_main start``) and checks
what a user sees: a non-zero exit, no "ready", exactly one line on stderr that
names the cause and the fix, and no traceback.  (A key that others can read is
in test_daemons.py, with the other key-mode checks.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from meshd.config import CONFIG_FILE
from meshd.control import SOCKET_FILE
from meshd.identity import KEY_FILE, create_identity
from meshd.testing.localmesh import Daemon

REPO = Path(__file__).resolve().parents[2]
KEY_FIX = "restore the key from a backup, or move it aside to start as a new identity"


def start_error(data_dir: Path, listen: str = "127.0.0.1:0") -> str:
    """Run ``meshd start``; assert that it failed in one line, and return the line."""
    out = subprocess.run([sys.executable, "-m", "cli.meshd_main", "start", "--data-dir", str(data_dir),
                          "--listen", listen], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "ready" not in out.stdout, (out.returncode, out.stdout)
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("meshd: error: "), lines[0]
    return lines[0]


def test_a_port_in_use_or_a_second_daemon_on_a_data_dir_is_one_line_with_the_fix(tmp_path):
    first = Daemon(tmp_path / "first").start(timeout=20)
    try:
        hostport = str(first.address.hostport)
        line = start_error(tmp_path / "other", listen=hostport)
        assert f"UDP {hostport} is in use by another program" in line
        assert "pick a free port with --listen HOST:PORT or [node] listen in config.toml" in line
        line = start_error(first.data_dir)
        assert f"another meshd is running with data dir {first.data_dir}" in line
        assert "stop it first, or use another --data-dir" in line
        assert first.meshctl("status")["peer_id"] == first.peer_id  # the first daemon serves on
    finally:
        first.stop()


@pytest.mark.parametrize("content", [b"[node]\nlisten = \"127.0.0.1:0\n", b"\x89PNG\r\n\x1a\n\x00\xff\xfe"],
                         ids=["broken-toml", "not-text"])
def test_a_corrupt_config_names_the_file_and_says_to_fix_it_or_move_it_aside(tmp_path, content):
    data_dir = tmp_path / "node"
    create_identity(data_dir)
    (data_dir / CONFIG_FILE).write_bytes(content)
    line = start_error(data_dir)
    assert f"{data_dir / CONFIG_FILE} is not valid TOML: " in line
    assert line.endswith("; fix it, or move it aside to start with the defaults"), line
    assert not (data_dir / SOCKET_FILE).exists()


def _truncated(pem: bytes) -> bytes:
    return pem[:len(pem) // 2]


def _zeroed(pem: bytes) -> bytes:
    return bytes(len(pem))


def _p256_key(pem: bytes) -> bytes:
    return ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


@pytest.mark.parametrize("damage, cause", [(_truncated, "is not a PEM private key"),
                                           (_zeroed, "is not a PEM private key"),
                                           (_p256_key, "not an Ed25519 key")],
                         ids=["truncated", "zeroed", "not-ed25519"])
def test_a_corrupt_identity_key_names_the_file_and_says_to_restore_or_move_it_aside(tmp_path, damage, cause):
    data_dir = tmp_path / "node"
    create_identity(data_dir)
    key = data_dir / KEY_FILE
    key.write_bytes(damage(key.read_bytes()))  # keeps mode 0600: the key's content is what is wrong
    damaged = key.read_bytes()
    line = start_error(data_dir)
    assert line.startswith(f"meshd: error: {key} ") and cause in line and KEY_FIX in line, line
    assert key.read_bytes() == damaged  # never replaced by a new key
    assert not (data_dir / SOCKET_FILE).exists()
