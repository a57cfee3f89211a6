"""Test doubles and harnesses that ship with the package (as ``trio.testing`` does).

:mod:`.localmesh` runs real ``meshd`` daemons as child processes on loopback;
the tests, the benchmarks and ``make demo`` use it.  :mod:`.attacks` is a
hostile peer process and :mod:`.abuse` the driver of the abuse test
(docs/security.md).
"""

from .localmesh import Daemon, DaemonError, wait_until

__all__ = ["Daemon", "DaemonError", "wait_until"]
