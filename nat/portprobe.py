"""Port-prediction probing decisions, with no I/O: a symmetric NAT meeting an easy one.

Plain hole punching fails when one side's NAT ("hard") picks a new public
port for every destination.  The method Tailscale describes wins by numbers:

* the hard side opens :data:`HARD_PORTS` extra UDP sockets and sends one
  packet from each to the easy side's public address, so its NAT holds that
  many mappings that accept packets from the easy side;
* the easy side sends :data:`EASY_PROBES` packets to random ports of the hard
  side's public IP (:func:`probe_ports`, paced by :func:`probe_batches`);
  each lands on one of those mappings with probability HARD_PORTS / 64512,
  so at least one does with probability :func:`hit_probability`, about
  99.97 % (2048 probes take ~0.2 s);
* the first extra socket that hears from the easy side carries the QUIC dial.

Both requests make the served side send hundreds of packets, so they are
served only to peers reached through a relay, once per :data:`ASK_INTERVAL`
each (:class:`ProbeAdmission`): never a way to aim traffic at others.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from typing import TypeVar

from .autonat import PerPeerInterval
from .behaviour import Mapping
from .errors import Malformed, Refused

HARD_PORTS = 256  # extra sockets (NAT mappings) the hard side opens
EASY_PROBES = 2048  # packets the easy side sends
PROBE_BATCH = 64  # probes sent between two short pauses
PROBE_GAP = 0.005
HIT_WAIT = 5.0  # seconds the hard side listens for a probe
DIAL_TIMEOUT = 5.0
ASK_INTERVAL = 30.0  # seconds between probing requests served for one peer
FIRST_PORT = 1024  # probes go to ports FIRST_PORT..65535, where NATs allocate
PORT_SPACE = 65536 - FIRST_PORT

EASY = frozenset({Mapping.NO_NAT, Mapping.ENDPOINT_INDEPENDENT})
HARD = frozenset({Mapping.ENDPOINT_DEPENDENT, Mapping.ADDRESS_DEPENDENT, Mapping.ADDRESS_AND_PORT_DEPENDENT})

T = TypeVar("T")


def role(mine: Mapping, theirs: Mapping) -> str | None:
    """Our side in probing: "hard" (open ports, wait for a hit), "easy" (send probes), or None.

    None unless exactly one side is hard and the other easy: both easy need
    no probing, both hard cannot be helped, and an UNKNOWN side is neither.
    """
    if mine in HARD and theirs in EASY:
        return "hard"
    if mine in EASY and theirs in HARD:
        return "easy"
    return None


def relayed_only(path: str | None, what: str) -> None:
    """Raise Refused "not_relayed" unless the request came over a relayed connection (``path``)."""
    if path != "relayed":
        raise Refused("not_relayed", f"{what} is asked for over a relayed connection")


class ProbeAdmission:
    """Who may make us probe or open ports: relayed peers, one request per :data:`ASK_INTERVAL`."""

    def __init__(self, interval: float = ASK_INTERVAL):
        self._interval = PerPeerInterval(interval, "port-probing request")

    def admit(self, peer: Hashable, path: str | None, now: float) -> None:
        """Count the request, or raise Refused "not_relayed" or "too_soon" (then not counted)."""
        relayed_only(path, "port probing")
        self._interval.admit(peer, now)


def parse_open_ports(arg: object) -> str:
    """The easy side's public ``HOST:PORT`` text from ``punch.open_ports``; Malformed otherwise."""
    if not isinstance(arg, dict) or not isinstance(arg.get("addr"), str):
        raise Malformed('expected {"addr": HOST:PORT}')
    return arg["addr"]


def parse_probe(arg: object) -> str:
    """The hard side's public IP text from ``punch.probe``; Malformed otherwise."""
    if not isinstance(arg, dict) or not isinstance(arg.get("ip"), str):
        raise Malformed('expected {"ip": HARD_SIDE_PUBLIC_IP}')
    return arg["ip"]


def probe_ports(rng: random.Random, count: int = EASY_PROBES) -> list[int]:
    """``count`` distinct ports from 1024..65535, uniformly at random, in random order."""
    return rng.sample(range(FIRST_PORT, 65536), count)


def probe_batches(ports: Sequence[T], batch: int = PROBE_BATCH,
                  gap: float = PROBE_GAP) -> list[tuple[list[T], float]]:
    """The probe schedule: ``(send to each of these, then pause)`` per ``batch`` probes.

    Each full batch is followed by ``gap``; a short last batch by 0 (no pause).
    """
    schedule = []
    for start in range(0, len(ports), batch):
        chunk = list(ports[start:start + batch])
        schedule.append((chunk, gap if len(chunk) == batch else 0.0))
    return schedule


def hit_probability(hard_ports: int = HARD_PORTS, probes: int = EASY_PROBES,
                    port_space: int = PORT_SPACE) -> float:
    """Chance that at least one of ``probes`` random ports is one of ``hard_ports`` open mappings.

    Each probe is taken as an independent hit with probability
    ``hard_ports / port_space``.
    """
    return 1 - (1 - hard_ports / port_space) ** probes
