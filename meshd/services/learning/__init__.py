"""Training across peers, the service ``learning``.

:class:`Learning` (:mod:`.service`) keeps the training groups a node is in;
:class:`Group` (:mod:`.group`) is one group as this member sees it: who is
live, and the signed tensor exchanges (pull, all-reduce).  The algorithms
users call are :class:`GossipAverager` (:mod:`.averager`),
:class:`DiLoCo` (:mod:`.diloco`, Streaming DiLoCo with ``fragments > 1``) and
:class:`IslandDiLoCo` (:mod:`.island`, DiLoCo for a torch.distributed group
whose rank 0 talks to the mesh); they import torch, the rest does not.
:mod:`.sessions` runs DiLoCo or gossip for a training script that uses this
node through its control socket (``learning.session``; torch is imported when
the first session opens).  The round logic is :mod:`learn`.
"""

from .config import LearningSection
from .group import Group
from .service import PROVIDER_PREFIX, Learning, check_group_name

__all__ = ["PROVIDER_PREFIX", "Group", "Learning", "LearningSection", "check_group_name"]
