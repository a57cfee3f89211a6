"""The client's ``learning.*`` methods: what training groups this node is in."""

from __future__ import annotations

from .base import ControlClient


class LearningMethods(ControlClient):
    async def learning_groups(self) -> list[dict]:
        """The training groups this node is a member of: group, algorithm, rule,
        round, live members, bytes in and out, this member's state hash, and
        ``known``: the membership document's entries by state (``live``,
        ``quiet``, ``left``; None without a document)."""
        return await self.request("learning.ls")

    async def learning_status(self, group: str) -> dict:
        """One group in detail: this member's round and hash; ``membership``: the
        membership document (``document``, ``owner``, ``writer``, ``entries`` by
        state, ``rejected``, ``note``: why there is none, or why this member's entry
        is not written); and ``members``: per live member its round, seconds since
        last heard, path, samples, times clipped, hash, whether its hash agrees with
        the majority, and per member with an entry in the document (gone ones too)
        ``joined`` (Unix time), ``role``, ``island``, ``samples_s``, ``steps_s``,
        ``doc_round``, ``doc_seen`` and ``state`` (None where it has no entry)."""
        return await self.request("learning.status", {"group": group})
