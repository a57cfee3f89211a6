"""Run real ``meshd`` daemons as child processes on loopback.

Used by ``make demo``, the integration tests and the benchmarks: each daemon
gets its own data directory, listens on 127.0.0.1 with a port the kernel
picks, and reports ``ready PEERID@HOST:PORT`` on stdout, which is what
:meth:`Daemon.start` waits for.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..address import PeerAddr
from ..config import CONFIG_FILE
from ..daemon import Config


class DaemonError(Exception):
    """A daemon did not start, or a meshctl command failed."""


class Daemon:
    """One ``meshd start`` process and the ``meshctl`` commands aimed at it."""

    def __init__(self, data_dir: Path, *, listen: str = "127.0.0.1:0",
                 bootstrap: list[str] | None = None, config: dict | None = None,
                 command_prefix: list[str] | None = None, env: dict | None = None):
        """``command_prefix`` goes before the daemon's command (``ip netns exec NS``)."""
        self.data_dir = Path(data_dir)
        self.command_prefix = command_prefix or []
        self.env = env
        self.listen = listen
        self.bootstrap = bootstrap or []
        self.config = config or {}
        self.proc: subprocess.Popen | None = None
        self.address: PeerAddr | None = None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "meshd.log"

    def start(self, timeout: float = 30.0) -> "Daemon":
        """Start the process and wait until it prints its address."""
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.config:
            config = Config.load(self.data_dir)
            config.update(self.config)
            (self.data_dir / CONFIG_FILE).write_text(config.render())
        cmd = [*self.command_prefix, sys.executable, "-m", "cli.meshd_main", "start",
               "--data-dir", str(self.data_dir), "--listen", self.listen]
        if self.bootstrap:
            cmd += ["--bootstrap", *self.bootstrap]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                     env=self.env)
        log.close()
        line = self._read_line(timeout)
        if not line.startswith("ready "):
            self.kill()
            raise DaemonError(f"meshd did not start: {line or 'no output'}; log: {self.tail_log()}")
        self.address = PeerAddr.parse(line.split(" ", 1)[1])
        return self

    def _read_line(self, timeout: float) -> str:
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                return ""
        return self.proc.stdout.readline().decode().strip()

    def tail_log(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    @property
    def peer_id(self) -> str:
        return str(self.address.peer_id)

    @property
    def dial_address(self) -> str:
        """``PEERID@HOST:PORT`` for other daemons' bootstrap lists (a lab daemon's says its namespace's host)."""
        return str(self.address)

    def meshctl(self, *args: str, timeout: float = 30.0) -> object:
        """Run ``meshctl --json ARGS`` against this daemon and return the parsed JSON."""
        out = self.meshctl_raw("--json", *args, timeout=timeout)
        if out.returncode != 0:
            raise DaemonError(out.stderr.strip())
        return json.loads(out.stdout)

    def meshctl_raw(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run ``meshctl ARGS`` as a user would; the caller reads its output."""
        cmd = [sys.executable, "-m", "cli.meshctl", "--data-dir", str(self.data_dir), *args]
        env = dict(os.environ, COLUMNS="200")
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait; returns the exit code (SIGKILL if it hangs)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9
        finally:
            self.proc.stdout.close()

    def kill(self) -> None:
        """SIGKILL: no chance to close anything."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate`` until it returns something truthy; DaemonError after ``timeout``.

    For conditions only visible from outside a process (another daemon's
    view); in-process code waits on events instead.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise DaemonError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
