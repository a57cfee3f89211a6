"""The client's methods for the node core: identity, status, peers, calls."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import ControlClient

if TYPE_CHECKING:  # annotations only: meshctl imports this without cryptography
    from ..identity import PeerId


class NodeMethods(ControlClient):
    async def id(self) -> dict:
        """``{peer_id, address}`` of the daemon."""
        return await self.request("id")

    async def status(self) -> dict:
        """Uptime, connections, transport counters and each service's status."""
        return await self.request("status")

    async def peers(self) -> list[dict]:
        """One dict per connected peer: address, path, direction, RTT, open streams."""
        return await self.request("peers")

    async def ping(self, peer: PeerId | str) -> float:
        """Round-trip time to ``peer`` in milliseconds."""
        return (await self.request("ping", {"peer": str(peer)}))["rtt_ms"]

    async def connect(self, addr: str, via: str | None = None) -> str:
        """Have the daemon dial ``PEERID@HOST:PORT``, or PEERID through relay ``via``.

        Returns the PeerId.
        """
        arg = {"addr": str(addr)} if via is None else {"peer": str(addr), "via": str(via)}
        return (await self.request("connect", arg))["peer_id"]

    async def disconnect(self, peer: PeerId | str) -> bool:
        """Close the daemon's connection to ``peer``; False if there was none."""
        return (await self.request("disconnect", {"peer": str(peer)}))["disconnected"]

    async def call(self, peer: PeerId | str, method: str, arg: object = None,
                   timeout: float = 30.0) -> object:
        """Unary RPC to ``peer`` made by the daemon on our behalf."""
        return await self.request(
            "call", {"peer": str(peer), "method": method, "arg": arg, "timeout": timeout},
            timeout=timeout + 5,
        )
