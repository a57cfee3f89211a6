"""Script processes of a soak: a training member or an expert server, each with its own in-process node.

A :class:`Script` is one process that prints one JSON object per line on
stdout (``{"ready": ADDRESS}`` first, once its node listens) and logs to a
file.  The driver reads its lines in a task of its own, so a harness waits on
what the scripts said (:meth:`Progress.until`), never on a clock; it kills a
script by its PID and reaps it.  A script that exits while nobody killed it
has crashed unless its last line says it finished (``{"done": ...}``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import trio

REPO = Path(__file__).resolve().parents[3]


def script_env() -> dict[str, str]:
    """The environment of a script: one torch thread (the soak shares few cores), the repo importable."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


class Progress:
    """Something the scripts of a harness said: ``until(predicate)`` waits for it, bounded."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate()`` holds (re-checked after every line any script prints),
        ``timeout`` s at most; whether it held."""
        with trio.move_on_after(timeout):
            while not predicate():
                await self._event.wait()
            return True
        return predicate()


class Window:
    """When the soak's work runs: scripts started early wait here for its deadline."""

    def __init__(self) -> None:
        self._set = trio.Event()
        self.deadline = 0.0

    def open(self, deadline: float) -> None:
        self.deadline = deadline
        self._set.set()

    async def wait(self) -> float:
        """The work's deadline, once the work has begun."""
        await self._set.wait()
        return self.deadline


@dataclass
class Script:
    """One script process: its command, what it printed, whether the harness killed it."""

    name: str
    cmd: list[str]
    log_path: Path
    progress: Progress
    process: trio.Process | None = None
    lines: list[dict] = field(default_factory=list)
    ready: dict | None = None
    done: dict | None = None
    killed: bool = False  # by the chaos
    stopped: bool = False  # by the teardown, still running at the end
    exited: trio.Event = field(default_factory=trio.Event)  # its stdout ended (it exited)
    started_at: float = 0.0  # trio clock
    ready_at: float | None = None

    async def start(self, nursery: trio.Nursery, timeout: float = 60.0) -> bool:
        """Start the process (its output read in ``nursery``) and wait for its ``ready`` line;
        False if it did not print one within ``timeout`` s (then it is killed)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started_at = trio.current_time()
        with open(self.log_path, "ab") as log:
            self.process = await trio.lowlevel.open_process(self.cmd, stdout=subprocess.PIPE, stderr=log,
                                                            stdin=subprocess.DEVNULL, env=script_env())
        nursery.start_soon(self._read)
        if await self.progress.until(lambda: self.ready is not None or self.exited.is_set(), timeout):
            if self.ready is not None:
                return True
        self.stop()
        return False

    async def _read(self) -> None:
        buffer = b""
        try:
            with open(self.log_path.with_suffix(".jsonl"), "a") as copy:  # what it said and when, beside its log
                async for chunk in self.process.stdout:
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for raw in lines:
                        line = self._take(raw)
                        copy.write(json.dumps({"time": round(time.time(), 3), **line}, default=str) + "\n")
                        copy.flush()
        except (trio.ClosedResourceError, trio.BrokenResourceError, OSError):
            pass  # the pipe went with the process
        finally:
            self.exited.set()
            self.progress.notify()

    def _take(self, raw: bytes) -> dict:
        try:
            line = json.loads(raw)
        except ValueError:
            line = {"text": raw.decode(errors="replace")}
        if not isinstance(line, dict):
            line = {"text": str(line)}
        line["_at"] = trio.current_time()  # when it came (trio clock)
        self.lines.append(line)
        if "ready" in line and self.ready is None:
            self.ready, self.ready_at = line, trio.current_time()
        if "done" in line:
            self.done = line
        self.progress.notify()
        return line

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """The chaos: SIGKILL the process by its PID."""
        self.killed = True
        self._sigkill()

    def stop(self) -> None:
        """The teardown: SIGKILL the process by its PID if it still runs (not a crash, not the chaos)."""
        if self.running:
            self.stopped = True
            self._sigkill()

    def _sigkill(self) -> None:
        if self.running:
            try:
                os.kill(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def reap(self, timeout: float = 10.0) -> int | None:
        """Wait (bounded) for the process to exit; its return code (None: still running)."""
        if self.process is None:
            return None
        with trio.move_on_after(timeout):
            await self.process.wait()
        return self.process.returncode

    def crash(self) -> str | None:
        """Why this process counts as crashed (it exited, unkilled, without finishing), or None."""
        if self.killed or self.stopped or self.process is None or self.process.returncode is None:
            return None
        if self.process.returncode == 0 and self.done is not None:
            return None
        return f"exit {self.process.returncode}: {self.tail_log(3)}"

    def tail_log(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def python(*args: str) -> list[str]:
    """A command line running this interpreter."""
    return [sys.executable, *args]
