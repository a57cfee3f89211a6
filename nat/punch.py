"""Hole-punching decisions, with no I/O (after libp2p's DCUtR).

When X reaches N only through a relay, X asks N over that relayed connection
(``punch.exchange``) for N's public addresses, sending its own.  Both sides
then send a short burst of STUN Binding requests from their one UDP socket to
the other's addresses (:func:`burst`), each opening its own NAT towards the
other, and dial.  N starts as soon as it answers; X waits half the round trip
after the answer (:func:`wait_before_dial`).  The two sides' NAT mapping
kinds decide whether to punch at all, or to probe ports instead
(:func:`choose_method`).

Addresses here are ``HOST:PORT`` texts; the shell parses and resolves them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

from .behaviour import Mapping
from .errors import Malformed
from .portprobe import HARD

BURST = 10  # packets per address
BURST_GAP = 0.02  # seconds between rounds
TRIES = 3  # exchanges (each with a burst and dials) before staying relayed
DIAL_TIMEOUT = 3.0
MAX_ADDRS = 8  # addresses taken from a peer, and offered to it

T = TypeVar("T")


def choose_method(mine: Mapping, theirs: Mapping) -> str | None:
    """"punch", "probe", or None (no method can work) for these two mapping kinds.

    Two destination-dependent ("hard") mappings: None.  One hard side meeting
    an endpoint-independent one: "probe" (port prediction, ``nat.portprobe``).
    Otherwise "punch": crossing bursts and dials work, including a hard side
    meeting a side with no NAT, which the hard side simply dials.
    """
    hard = (mine in HARD) + (theirs in HARD)
    if hard == 2:
        return None
    if hard == 1 and Mapping.ENDPOINT_INDEPENDENT in (mine, theirs):
        return "probe"
    return "punch"


def mapping_of(reply: object) -> Mapping:
    """The mapping kind a peer reported in its exchange reply; UNKNOWN if absent or unknown."""
    if not isinstance(reply, dict):
        return Mapping.UNKNOWN
    try:
        return Mapping(reply.get("mapping"))
    except ValueError:
        return Mapping.UNKNOWN


def parse_addresses(arg: object) -> list[str]:
    """The first :data:`MAX_ADDRS` address texts of an exchange request or reply.

    Raises Malformed unless ``arg`` is ``{"addrs": [str, ...]}`` (entries past
    the first ``MAX_ADDRS`` are not looked at).  Whether each text is a valid
    HOST:PORT is for the caller's parser.
    """
    if not isinstance(arg, dict) or not isinstance(arg.get("addrs"), list):
        raise Malformed('expected {"addrs": [HOST:PORT, ...]}')
    texts = arg["addrs"][:MAX_ADDRS]
    for text in texts:
        if not isinstance(text, str):
            raise Malformed(f"bad address {text!r}")
    return texts


def public_addresses(mapped: str | None, reflexive: Iterable[str], listen: str) -> list[str]:
    """Where others may reach our socket, best first, at most :data:`MAX_ADDRS`.

    The port-mapped address (``mapped``, if any), then the reflexive
    addresses STUN reported, without repeats; then ``listen`` unless it is a
    wildcard (``0.0.0.0:P`` or ``[::]:P``), which names no reachable host.
    """
    seen = list(dict.fromkeys(([mapped] if mapped else []) + list(reflexive)))
    if not listen.startswith(("0.0.0.0", "[::]")):
        seen.append(listen)
    return seen[:MAX_ADDRS]


def burst(targets: Sequence[T], count: int = BURST, gap: float = BURST_GAP) -> list[tuple[list[T], float]]:
    """The burst schedule: ``count`` rounds of ``(send one packet to each of these, then pause)``."""
    return [(list(targets), gap) for _ in range(count)]


def wait_before_dial(exchange_started: float, answered: float) -> float:
    """Seconds the asker waits after the reply before bursting and dialing: half the round trip.

    As DCUtR's dialer waits RTT/2: the answering side began as it replied, so
    by the time the asker's packets arrive its own burst has opened its NAT.
    """
    return (answered - exchange_started) / 2
