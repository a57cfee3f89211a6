"""The client's ``dht.*`` methods: records and providers in the Kademlia DHT."""

from __future__ import annotations

from .base import ControlClient


class DhtMethods(ControlClient):
    async def dht_put(self, key: bytes, value: bytes, ttl: float | None = None) -> int:
        """Store ``value`` under ``key`` (``b"/open/NAME"`` or ``b"/owned/<our key hex>/NAME"``),
        signed by the daemon's key, for ``ttl`` seconds (default ``dht.record_ttl``).

        Returns how many other nodes took it; raises InvalidArgument when the
        record is refused (unknown namespace, value over 16 KiB, another's key).
        """
        arg = {"key": key, "value": value} if ttl is None else {"key": key, "value": value, "ttl": ttl}
        return (await self.request("dht.put", arg))["replicas"]

    async def dht_get(self, key: bytes) -> dict | None:
        """The best record found under ``key``: ``{key, value, author (PeerId),
        seq, expires (unix time)}``, or None."""
        return await self.request("dht.get", {"key": key})

    async def dht_provide(self, key: bytes) -> int:
        """Announce the daemon as a provider of ``key`` (re-announced until it
        stops); returns how many other nodes took the announcement."""
        return (await self.request("dht.provide", {"key": key}))["replicas"]

    async def dht_providers(self, key: bytes, count: int = 20) -> list[dict]:
        """Up to ``count`` providers of ``key``: ``[{peer_id, addrs}]``."""
        return await self.request("dht.providers", {"key": key, "count": count})

    async def dht_routing(self) -> dict:
        """The DHT routing table: mode, size, buckets, contacts (peer_id, addrs,
        bucket), and how many records and provided keys are held."""
        return await self.request("dht.routing")
