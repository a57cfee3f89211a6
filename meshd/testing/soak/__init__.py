"""The chaos soak: many real daemons doing mixed work while some are killed and cut off.

:func:`run_soak` starts the :class:`Cluster` s (:func:`loopback_cluster`, or
lab clusters the caller builds), runs document writes, DHT puts and gets and
model publishes and fetches against random live daemons while the chaos
SIGKILLs and restarts them and cuts links (and, beside the loopback cluster,
DiLoCo member processes training one group and expert server processes
answering a caller, one of each SIGKILLed and restarted: ``training.py``,
``expert_calls.py``), then checks that every acknowledged write is on every
replica, every completed fetch verified, every live member on one hash after
its last round, every expert call answered correctly or failed cleanly, no
process crashed and memory stayed bounded.  :func:`print_report` prints what
it did and what it checked.  ``tests/daemon/test_soak.py`` runs a short one,
``benchmarks/soak.py`` the long one (docs/soak.md).
"""

from .chaos import ChaosLog, ChaosPlan
from .checks import Check
from .expert_calls import ExpertLog, ExpertPlan
from .mesh import Cluster, Cut, Slot, loopback_cluster
from .report import print_report
from .run import SOAK_CONFIG, SoakPlan, SoakReport, run_soak
from .training import TrainingLog, TrainingPlan
from .work import Ledger, Pace

__all__ = [
    "SOAK_CONFIG", "ChaosLog", "ChaosPlan", "Check", "Cluster", "Cut", "ExpertLog", "ExpertPlan", "Ledger", "Pace",
    "Slot", "SoakPlan", "SoakReport", "TrainingLog", "TrainingPlan", "loopback_cluster", "print_report", "run_soak",
]
