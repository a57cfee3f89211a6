"""The client's ``experts.*`` methods: experts this node serves, and one call to any."""

from __future__ import annotations

from .base import ControlClient


class ExpertsMethods(ControlClient):
    async def experts_ls(self, find: list[str] | None = None, *, all: bool = False) -> list[dict]:
        """The experts this node serves (id, kind, domain, params, model, load); with ``all``,
        also every other expert the registry document lists; with ``find``, also those ids
        as the DHT finds them (servers, and what the first says)."""
        return (await self.request("experts.ls", {"find": list(find or []), "all": all}))["experts"]

    async def experts_call(self, expert: str, inputs: list[dict], *, op: str = "forward",
                           peer: str | None = None) -> dict:
        """One call to ``expert`` (on ``peer``, or its first server) with ``inputs``
        (``{"dtype", "shape", "data"}`` maps): the outputs as such maps, who
        answered, in how many ms, and the rows of the batch it ran in."""
        return await self.request("experts.call", {"expert": expert, "op": op, "inputs": inputs, "peer": peer})
