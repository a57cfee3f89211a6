"""The client's ``experts.*`` methods: experts this node serves, one call to any, serving from files."""

from __future__ import annotations

from .base import ControlClient

SERVE_TIMEOUT = 600  # seconds a serve may take: the daemon imports torch and the factory, and loads the weights


class ExpertsMethods(ControlClient):
    async def experts_ls(self, find: list[str] | None = None, *, all: bool = False) -> list[dict]:
        """The experts this node serves (id, kind, domain, params, model, load); with ``all``,
        also every other expert the registry document lists; with ``find``, also those ids
        as the DHT finds them (servers, and what the first that answers says).  Every row
        has ``peers`` (each server's ``health``: ok, stale, backed-off or failing, and
        ``latency_ms``: the EWMA of this node's calls to it, or an info round trip just
        now with ``find``) and sums them up in ``health`` and ``latency_ms``."""
        return (await self.request("experts.ls", {"find": list(find or []), "all": all}))["experts"]

    async def experts_call(self, expert: str, inputs: list[dict], *, op: str = "forward",
                           peer: str | None = None) -> dict:
        """One call to ``expert`` (on ``peer``, or its first server) with ``inputs``
        (``{"dtype", "shape", "data"}`` maps): the outputs as such maps, who
        answered, in how many ms, and the rows of the batch it ran in."""
        return await self.request("experts.call", {"expert": expert, "op": op, "inputs": inputs, "peer": peer})

    async def experts_serve(self, expert: str, factory: str, weights: str | None = None, *,
                            kwargs: dict | None = None, search: list[str] | None = None, kind: str = "module",
                            domain: str | None = None, dim: int | None = None, max_batch: int = 32,
                            max_wait_ms: float = 5.0, timeout: float = SERVE_TIMEOUT) -> dict:
        """Have the daemon serve ``expert``: the module ``factory`` (``MODULE:NAME``: a dotted
        module, found on the daemon's path and ``search``, or an absolute ``.py`` path)
        returns for ``kwargs``, with the state_dict in ``weights`` (an absolute path:
        ``.safetensors``, or a torch.save file read weights-only) loaded into it.  It serves
        until :meth:`experts_unserve` or the daemon stops.  Returns the expert's info."""
        return await self.request("experts.serve", {
            "expert": expert, "factory": factory, "weights": weights, "kwargs": kwargs or {},
            "search": list(search or []), "kind": kind, "domain": domain, "dim": dim,
            "max_batch": max_batch, "max_wait_ms": max_wait_ms}, timeout=timeout)

    async def experts_unserve(self, expert: str) -> dict:
        """Stop serving ``expert`` on the daemon (callers go to its other servers)."""
        return await self.request("experts.unserve", {"expert": expert})
