"""How the DHT reaches peers: one small interface, two implementations.

meshd implements :class:`Network` over its RPC layer; :mod:`dht.simnet`
implements it in memory for simulations of thousands of nodes.  Messages
are plain maps of msgpack-able values, the same in both.
"""

from __future__ import annotations

from typing import Protocol

from .ids import Contact

PING = "dht.ping"
FIND_NODE = "dht.find_node"
GET_VALUE = "dht.get_value"
PUT_VALUE = "dht.put_value"
ADD_PROVIDER = "dht.add_provider"
GET_PROVIDERS = "dht.get_providers"
METHODS = (PING, FIND_NODE, GET_VALUE, PUT_VALUE, ADD_PROVIDER, GET_PROVIDERS)


class DhtError(Exception):
    """Base of the DHT's errors."""


class Unreachable(DhtError):
    """A peer could not be asked: no connection, timeout, or it went away."""


class Refused(DhtError):
    """A request was understood and refused: malformed, over a limit, or rate-limited."""


class RateLimited(Refused):
    """A peer sent more than its share of requests; it may retry later."""


class Network(Protocol):
    async def call(self, contact: Contact, method: str, msg: dict) -> dict:
        """Send ``msg`` to ``contact``'s ``method`` and return its answer.

        Raises Unreachable when the peer cannot be asked and Refused when it
        refuses; the caller bounds the time with its own deadline.
        """
        ...
