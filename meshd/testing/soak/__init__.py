"""The chaos soak: many real daemons doing mixed work while some are killed and cut off.

:func:`run_soak` starts the :class:`Cluster` s (:func:`loopback_cluster`, or
lab clusters the caller builds), runs document writes, DHT puts and gets and
model publishes and fetches against random live daemons while the chaos
SIGKILLs and restarts them and cuts links, then checks that every
acknowledged write is on every replica, every completed fetch verified, no
daemon crashed and memory stayed bounded.  :func:`print_report` prints what
it did and what it checked.  ``tests/daemon/test_soak.py`` runs a short one,
``benchmarks/soak.py`` the long one (docs/soak.md).
"""

from .chaos import ChaosLog, ChaosPlan
from .checks import Check
from .mesh import Cluster, Cut, Slot, loopback_cluster
from .report import print_report
from .run import SOAK_CONFIG, SoakPlan, SoakReport, run_soak
from .work import Ledger, Pace

__all__ = [
    "SOAK_CONFIG", "ChaosLog", "ChaosPlan", "Check", "Cluster", "Cut", "Ledger", "Pace", "Slot", "SoakPlan",
    "SoakReport", "loopback_cluster", "print_report", "run_soak",
]
