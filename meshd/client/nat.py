"""The client's methods for NAT traversal: reachability, STUN, relays, hole punching."""

from __future__ import annotations

from .base import ControlClient


class NatMethods(ControlClient):
    async def nat(self, discover: bool = False, autonat: bool = False) -> dict:
        """Reflexive addresses, NAT mapping and reachability.

        ``discover`` first asks the configured STUN servers and every
        connected peer, and classifies the mapping from their answers;
        ``autonat`` first asks peers to have a third peer dial us back.
        """
        return await self.request("nat", {"discover": discover, "autonat": autonat})

    async def stun(self, server: str) -> str:
        """Ask the STUN server at HOST:PORT for our reflexive address now."""
        return (await self.request("stun", {"server": server}))["reflexive"]

    async def relay(self, reserve: str | None = None) -> dict:
        """Relay reservations, after reserving a slot at relay PeerId ``reserve`` if given."""
        return await self.request("relay", {} if reserve is None else {"reserve": str(reserve)})

    async def punch(self, peer: str) -> bool:
        """Try hole punching to ``peer`` (reached through a relay) now; True if direct."""
        return (await self.request("punch", {"peer": str(peer)}, timeout=60))["punched"]
