"""The DHT service's control methods: ``dht.put``, ``dht.get``, ``dht.provide``,
``dht.providers`` and ``dht.routing``.

The DHT's own errors become RPC errors: a refused record (unknown namespace,
too large, another's key) is INVALID_ARGUMENT, the rest UNAVAILABLE.
"""

from __future__ import annotations

from dht.ids import Contact
from dht.network import DhtError
from dht.node import DhtNode
from dht.records import RecordError

from ...identity import PeerId
from ...rpc import InvalidArgument, Unavailable
from ...rpc.args import field


def control_methods(dht: DhtNode, me: PeerId) -> dict:
    """The ``dht.*`` control methods over ``dht``, the node ``me``'s DHT."""

    async def put(arg, ctx):
        key, value = field(arg, "key", bytes), field(arg, "value", bytes)
        ttl = arg.get("ttl")
        if ttl is not None and (not isinstance(ttl, (int, float)) or ttl <= 0):
            raise InvalidArgument("ttl must be a positive number of seconds")
        return {"key": key, "replicas": await dht.put(key, value, ttl=ttl)}

    async def get(arg, ctx):
        record = await dht.get(field(arg, "key", bytes))
        if record is None:
            return None
        return {"key": record.key, "value": record.value, "author": str(PeerId(record.public_key)),
                "seq": record.seq, "expires": record.expires}

    async def provide(arg, ctx):
        key = field(arg, "key", bytes)
        return {"key": key, "replicas": await dht.provide(key)}

    async def providers(arg, ctx):
        key = field(arg, "key", bytes)
        count = arg.get("count", 20)
        if type(count) is not int or not 0 < count <= 1000:
            raise InvalidArgument("count must be an integer from 1 to 1000")
        found = await dht.find_providers(key, count)
        return [_contact(contact) for contact in found]

    async def routing(arg, ctx):
        info = dht.routing_info()
        info["peer_id"] = str(me)
        info["contacts"] = [{"peer_id": str(PeerId(bytes.fromhex(c.pop("public_key")))), **c}
                            for c in info["contacts"]]
        return info

    methods = {"dht.put": put, "dht.get": get, "dht.provide": provide, "dht.providers": providers,
               "dht.routing": routing}
    return {name: _dht_errors(handler) for name, handler in methods.items()}


def _contact(contact: Contact) -> dict:
    return {"peer_id": str(PeerId(contact.public_key)), "addrs": list(contact.addrs)}


def _dht_errors(handler):
    """``handler`` with the DHT's errors as RPC errors."""

    async def wrapped(arg, ctx):
        try:
            return await handler(arg, ctx)
        except RecordError as exc:
            raise InvalidArgument(str(exc)) from None
        except DhtError as exc:
            raise Unavailable(f"DHT: {exc}") from None

    return wrapped
