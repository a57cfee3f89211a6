"""Why a NAT-traversal core said no: one exception family with a ``kind``.

The sans-IO cores (``nat.relay``, ``nat.autonat``, ``nat.punch``,
``nat.portprobe``) know no RPC.  They raise :class:`Refused` when a rule turns
a request down and :class:`Malformed` when a peer's message has the wrong
shape; the trio shell catches :class:`NatError` and picks its RPC error from
``kind`` alone, passing ``str(exc)`` on as the message:

=============== ===================================================== ==================
kind            meaning                                               meshd RPC error
=============== ===================================================== ==================
disabled        this node does not offer the service (relaying off)   PERMISSION_DENIED
full            no room for another reservation                       RESOURCE_EXHAUSTED
no_reservation  no live reservation (or no connection) for the target NOT_FOUND
busy            the reservation has its most circuits open            RESOURCE_EXHAUSTED
too_soon        this peer asked less than an interval ago             RESOURCE_EXHAUSTED
pointless       the answer would prove nothing (AutoNAT dial-back)    RESOURCE_EXHAUSTED
not_relayed     asked over a direct path; only relayed peers may ask  INVALID_ARGUMENT
malformed       a message from the network has the wrong shape        INVALID_ARGUMENT
=============== ===================================================== ==================
"""

from __future__ import annotations

REFUSALS = frozenset({"disabled", "full", "no_reservation", "busy", "too_soon", "pointless", "not_relayed"})


class NatError(Exception):
    """Base of the cores' errors; ``kind`` names the rule or the fault."""

    kind: str


class Refused(NatError):
    """A rule turned the request down; ``kind`` is one of :data:`REFUSALS`."""

    def __init__(self, kind: str, message: str):
        if kind not in REFUSALS:
            raise ValueError(f"unknown refusal kind {kind!r}")
        super().__init__(message)
        self.kind = kind


class Malformed(NatError, ValueError):
    """A message from the network does not have the shape the protocol gives it."""

    kind = "malformed"
