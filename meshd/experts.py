"""Expert ensembles, for scripts: ``import meshd.experts as mx``.

::

    # on each expert's machine
    await mx.serve(node, expert_module, expert_id="code-small", kind="lm", domain="code",
                   max_batch=32, max_wait_ms=5)
    # anywhere on the mesh
    ens = mx.HDEEEnsemble(node, ["code-small", "legal-large", "docs-medium"], prior="uniform")
    logp, scored = await ens.next_token_logprobs(context_ids)   # scored.answered: who was in the mixture
    ddm = mx.DDMEnsemble(node, ["c0", "c1", "c2", "c3"], router="ddm-router", mode="topk", top_k=2)
    out = await ddm.sample(64, dim=2, steps=100)
    expert = mx.RemoteExpert(node, "c0")                         # like a module: await expert(x, t)

Kinds: ``lm`` (a module from token ids [B, T] to logits [B, T, V]; called
with op ``score``), ``flow`` (``v(x, t)``), ``router`` (logits over experts
given ``(x, t)``) and ``module`` (anything: ``module(*tensors)``).  Needs the
node's ``experts`` service (on by default); see docs/experts.md.
"""

from __future__ import annotations

from .services.experts.ensembles import DDMEnsemble, HDEEEnsemble, Sampled, Scored
from .services.experts.remote import Answer, ExpertUnavailable, RemoteExpert
from .services.experts.served import Served


async def serve(node, module, *, expert_id: str, kind: str = "module", domain: str | None = None,
                model: str | None = None, max_batch: int = 32, max_wait_ms: float = 5.0) -> Served:
    """Serve ``module`` on ``node`` as expert ``expert_id`` (announced in the DHT) until the node stops."""
    return await node.service("experts").serve(expert_id, module, kind=kind, domain=domain, model=model,
                                               max_batch=max_batch, max_wait_ms=max_wait_ms)


__all__ = ["Answer", "DDMEnsemble", "ExpertUnavailable", "HDEEEnsemble", "RemoteExpert", "Sampled", "Scored",
           "Served", "serve"]
