"""The daemons of a soak: slots that outlive their processes, clusters, link cuts.

A :class:`Slot` is one daemon's place (a name and a data dir): the chaos kills
its process and starts a new one on the same data dir, so the identity and the
stored documents, records and chunks stay.  A :class:`Cluster` is the slots
that can reach each other (loopback, or one NAT lab); its first slot is the
seed: the others bootstrap through it, it owns the document and publishes the
models, and it is never killed.  A :class:`Cut` takes a slot off the network
and puts it back (the lab cuts a NAT router's forwarding).

Everything here is blocking (process starts, ``/proc`` reads); the driver
calls it through ``trio.to_thread`` where it may take long.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..localmesh import Daemon

MIB = 1 << 20


@dataclass
class Slot:
    """One daemon's place in the soak.

    ``make(bootstrap)`` returns a new, unstarted :class:`Daemon` on this
    slot's data dir.  ``up`` is what the driver expects: True while the
    process should be running, so a process that is gone while ``up`` has
    crashed.  ``peak_rss`` is the most resident memory any of its processes
    had (bytes), read before each kill and at every sample.  ``busy`` counts
    the operations in flight on it, so the chaos can strike mid-operation.
    """

    name: str
    make: Callable[[list[str]], Daemon]
    daemon: Daemon | None = None
    up: bool = False
    kills: int = 0
    peak_rss: int = 0
    busy: int = 0
    crashes: list[str] = field(default_factory=list)

    def start(self, bootstrap: list[str], timeout: float = 30.0) -> Daemon:
        """Start a new process on the slot's data dir and wait for its ``ready`` line."""
        daemon = self.make(bootstrap)
        self.daemon = daemon
        daemon.start(timeout)
        self.up = True
        return daemon

    def kill(self) -> None:
        """SIGKILL the slot's process (by its PID), after reading its peak memory."""
        self.up = False
        self.sample_rss()
        self.daemon.kill()
        self.kills += 1
        _close_stdout(self.daemon)

    def sample_rss(self) -> int:
        """Fold the process's peak resident memory (VmHWM) into ``peak_rss``; its current RSS."""
        status = _proc_status(self.daemon)
        self.peak_rss = max(self.peak_rss, status.get("VmHWM", 0))
        return status.get("VmRSS", 0)

    def check_alive(self) -> bool:
        """False (and a line in ``crashes``) if the process exited while it was meant to run."""
        if not self.up or self.daemon.running:
            return True
        self.up = False
        code = self.daemon.proc.returncode
        self.crashes.append(f"exit {code}: {self.daemon.tail_log(5)}")
        _close_stdout(self.daemon)
        return False

    def stop(self) -> None:
        """Kill whatever still runs (teardown: pass or fail, only this slot's own process)."""
        if self.daemon is not None and self.daemon.proc is not None:
            self.daemon.kill()
            _close_stdout(self.daemon)
        self.up = False


@dataclass
class Cut:
    """Taking ``name`` off the network (``cut()``) and putting it back (``restore()``)."""

    name: str
    cut: Callable[[], None]
    restore: Callable[[], None]


@dataclass
class Cluster:
    """Slots that reach each other; ``slots[0]`` is the seed (never killed).  ``local``: a
    process started here (a training member, an expert server) can reach the seed."""

    name: str
    slots: list[Slot]
    cuts: list[Cut] = field(default_factory=list)
    local: bool = False

    @property
    def seed(self) -> Slot:
        return self.slots[0]

    @property
    def victims(self) -> list[Slot]:
        """The slots the chaos may kill: all but the seed."""
        return self.slots[1:]

    def live(self) -> list[Slot]:
        return [slot for slot in self.slots if slot.up]


def loopback_cluster(root: Path, nodes: int, config: dict, name: str = "loopback") -> Cluster:
    """``nodes`` daemons on 127.0.0.1 with data dirs ``root/NAME-i``, all with ``config``.

    The kernel picks each daemon's port at its first start; a restart listens
    on the same port, as a daemon with a configured port does.
    """

    def slot(i: int) -> Slot:
        data_dir = Path(root) / f"{name}-{i:02}"
        made: list[Daemon] = []

        def make(bootstrap: list[str]) -> Daemon:
            port = made[-1].address.hostport.port if made and made[-1].address else 0
            made[:] = [Daemon(data_dir, listen=f"127.0.0.1:{port}", bootstrap=bootstrap, config=config)]
            return made[0]

        return Slot(data_dir.name, make)

    return Cluster(name, [slot(i) for i in range(nodes)], local=True)


def _proc_status(daemon: Daemon) -> dict[str, int]:
    """VmRSS and VmHWM of the daemon's process in bytes (empty once it is gone)."""
    try:
        with open(f"/proc/{daemon.proc.pid}/status") as f:
            lines = f.read().splitlines()
    except (FileNotFoundError, ProcessLookupError):
        return {}
    found = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024
    return found


def _close_stdout(daemon: Daemon) -> None:
    if daemon.proc is not None and daemon.proc.stdout is not None:
        daemon.proc.stdout.close()
