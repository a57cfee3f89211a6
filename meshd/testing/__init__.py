"""Test doubles and harnesses that ship with the package (as ``trio.testing`` does).

:mod:`.localmesh` runs real ``meshd`` daemons as child processes on loopback;
the tests, the benchmarks and ``make demo`` use it.
"""

from .localmesh import Daemon, DaemonError, wait_until

__all__ = ["Daemon", "DaemonError", "wait_until"]
