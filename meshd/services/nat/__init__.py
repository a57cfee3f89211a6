"""NAT traversal, the service ``nat``: the trio shells over the sans-IO :mod:`nat` library.

``stun`` answers and asks STUN on the node's socket; ``autonat`` learns
whether strangers can reach us; ``relay`` carries QUIC for NATed peers;
``punch`` and ``portprobe`` find a direct path over a relayed one (with our
``interfaces``' addresses as host candidates); ``portmap`` asks the home
gateway for a port (PCP, NAT-PMP or UPnP-IGD: ``pcp``, ``upnp``); ``lan`` finds peers on the LAN by multicast
beacons.  :class:`Nat` ties them to the node.
"""

from .config import NatSection, RelaySection
from .service import Nat

__all__ = ["Nat", "NatSection", "RelaySection"]
