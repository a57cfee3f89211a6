"""Expert ensembles, for scripts: ``import meshd.experts as mx``.

::

    # on each expert's machine
    await mx.serve(node, expert_module, expert_id="code-small", kind="lm", domain="code",
                   max_batch=32, max_wait_ms=5)
    # anywhere on the mesh
    ens = mx.HDEEEnsemble(node, ["code-small", "legal-large", "docs-medium"], prior="uniform")
    logp = await ens.next_token_logprobs(context_ids)   # .logp [V]; .answered, .dropped, .weights
    ddm = mx.DDMEnsemble(node, experts=["c0", "c1", "c2", "c3"], router="ddm-router", top_k=1)  # top-1
    x = await ddm.sample(n=64, steps=100)               # .x [64, dim]: dim from the experts' info
    expert = mx.RemoteExpert(node, "c0")                         # like a module: await expert(x, t)
    await mx.publish(node, module, expert_id="c0", kind="flow")  # weights through shard sync, then served
    await mx.replicate(other_node, same_architecture, expert_id="c0")   # fetched, verified, served there too
    served, losses = await mx.train_and_publish(node, module, loss, 800, expert_id="c1", kind="flow")

Training on one machine (no network): :func:`kmeans` splits data into
clusters, :func:`train_flow` fits a flow-matching expert to one, and
:func:`train_router` the DDM router to all; :func:`fit` is their AdamW loop
for any other loss; ``HDEEEnsemble.estimate_prior`` learns an HDEE prior
from held-out text.

``next_token_logprobs`` still unpacks as ``logp, scored``.  A DDM
ensemble's mode follows ``top_k`` when ``mode`` is not given (1: ``top1``,
more: ``topk``; neither: ``full``).  :func:`load_module` builds a module
from a factory and a weights file as ``meshctl experts serve`` does.

Kinds: ``lm`` (a module from token ids [B, T] to logits [B, T, V]; called
with op ``score``), ``flow`` (``v(x, t)``), ``router`` (logits over experts
given ``(x, t)``) and ``module`` (anything: ``module(*tensors)``).  Needs the
node's ``experts`` service (on by default); see docs/experts.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import trio

from experts.training import fit, kmeans, train_flow, train_router

from .services.experts.ensembles import DDMEnsemble, HDEEEnsemble, NextToken, Sampled, Scored
from .services.experts.loading import LoadError, load_module
from .services.experts.remote import Answer, ExpertUnavailable, RemoteExpert
from .services.experts.served import Served


async def serve(node, module, *, expert_id: str, kind: str = "module", domain: str | None = None,
                model: str | None = None, max_batch: int = 32, max_wait_ms: float = 5.0,
                dim: int | None = None) -> Served:
    """Serve ``module`` on ``node`` as expert ``expert_id`` (announced in the DHT) until the node stops.
    ``dim`` (default: the module's ``dim`` attribute) tells ensembles the vectors' size."""
    return await node.service("experts").serve(expert_id, module, kind=kind, domain=domain, model=model,
                                               max_batch=max_batch, max_wait_ms=max_wait_ms, dim=dim)


async def publish(node, module, *, expert_id: str, kind: str = "module", domain: str | None = None,
                  max_batch: int = 32, max_wait_ms: float = 5.0, dim: int | None = None) -> Served:
    """Publish ``module``'s weights through shard sync (model ``experts/EXPERT_ID``, a new
    version each time) and serve it, its info naming the model id, so that any node can
    fetch the weights and serve a copy (:func:`replicate`).  Needs the ``shards`` service."""
    manifest = await node.service("shards").publish(module.state_dict(), name=f"experts/{expert_id}")
    return await serve(node, module, expert_id=expert_id, kind=kind, domain=domain, model=manifest.id.hex(),
                       max_batch=max_batch, max_wait_ms=max_wait_ms, dim=dim)


async def replicate(node, module, *, expert_id: str, max_batch: int = 32, max_wait_ms: float = 5.0) -> Served:
    """Serve one more copy of a published expert from ``node``: ask one of its servers what it
    is (kind, domain, model id), fetch the weights by shard sync (verified, from whoever has
    them) into ``module`` (the same architecture; ``load_state_dict`` is strict), and serve it.
    ExpertUnavailable if nobody serves the expert; ValueError if it was not published."""
    servers = await RemoteExpert(node, expert_id).servers()
    if not servers:
        raise ExpertUnavailable(f"nobody serves expert {expert_id!r}")
    info = await node.service("experts").info(servers[0], expert_id)
    model = info.get("model")
    if not isinstance(model, str) or len(model) != 64:
        raise ValueError(f"expert {expert_id!r} names no published model (serve it with publish())")
    module.load_state_dict(await node.service("shards").fetch(model))
    dim = info.get("dim") if type(info.get("dim")) is int else None
    return await serve(node, module, expert_id=expert_id, kind=info.get("kind", "module"), domain=info.get("domain"),
                       model=model, max_batch=max_batch, max_wait_ms=max_wait_ms, dim=dim)


async def train_and_publish(node, module: torch.nn.Module, loss: Callable[[torch.Generator], torch.Tensor],
                            steps: int, *, expert_id: str, kind: str = "module", domain: str | None = None,
                            lr: float = 1e-3, seed: int = 0, clip: float | None = None, max_batch: int = 32,
                            max_wait_ms: float = 5.0, dim: int | None = None) -> tuple[Served, list[float]]:
    """Train ``module`` in place on this machine's split, then :func:`publish` and serve it.

    ``steps`` AdamW steps on ``loss(generator)`` (:func:`experts.training.fit`:
    the batches drawn from a generator seeded with ``seed``), run in a worker
    thread so the node keeps answering meanwhile.  Returns what is served and
    the per-step losses."""
    losses = await trio.to_thread.run_sync(lambda: fit(module, steps, lr, seed, loss, clip=clip))
    module.eval()
    served = await publish(node, module, expert_id=expert_id, kind=kind, domain=domain, max_batch=max_batch,
                           max_wait_ms=max_wait_ms, dim=dim)
    return served, losses


__all__ = ["Answer", "DDMEnsemble", "ExpertUnavailable", "HDEEEnsemble", "LoadError", "NextToken", "RemoteExpert",
           "Sampled", "Scored", "Served", "fit", "kmeans", "load_module", "publish", "replicate", "serve",
           "train_and_publish", "train_flow", "train_router"]
