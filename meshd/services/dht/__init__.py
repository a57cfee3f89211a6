"""The Kademlia DHT over meshd RPC, the service ``dht``: the trio shell over :mod:`dht`.

:class:`Dht` serves the DHT's requests, runs its timers, joins the network,
and tells the node where peers are; other services use its
:class:`~dht.node.DhtNode` (``Dht.node``) for provider records.
"""

from .config import DhtSection
from .service import Dht, RpcNetwork

__all__ = ["Dht", "DhtSection", "RpcNetwork"]
