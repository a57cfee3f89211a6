"""The client's ``learning.*`` methods: what training groups this node is in."""

from __future__ import annotations

from .base import ControlClient


class LearningMethods(ControlClient):
    async def learning_groups(self) -> list[dict]:
        """The training groups this node is a member of: group, algorithm, rule,
        round, live members, bytes in and out, and this member's state hash."""
        return await self.request("learning.ls")

    async def learning_status(self, group: str) -> dict:
        """One group in detail: this member's round and hash, and per member its
        round, seconds since last heard, path, samples, times clipped, hash,
        and whether its hash agrees with the majority."""
        return await self.request("learning.status", {"group": group})
