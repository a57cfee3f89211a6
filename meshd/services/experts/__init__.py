"""Expert ensembles, the service ``experts``.

:class:`Experts` (:mod:`.service`) serves a node's experts (:mod:`.served`:
queued, batched calls) and finds and calls others'; :class:`RemoteExpert`
(:mod:`.remote`) picks among an expert's servers by measured latency, hedges
and retries, and sends concurrent calls as fewer requests;
:class:`HDEEEnsemble` and :class:`DDMEnsemble` (:mod:`.ensembles`) mix
experts; :mod:`.loading` builds a module from a factory and a weights file for
``meshctl experts serve`` (torch only then). The mixing math is
:mod:`experts`.
"""

from .config import ExpertsSection
from .service import PROVIDER_PREFIX, Experts, check_expert_id

__all__ = ["PROVIDER_PREFIX", "Experts", "ExpertsSection", "check_expert_id"]
