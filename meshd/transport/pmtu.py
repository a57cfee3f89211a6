"""Path MTU discovery for one QUIC path (RFC 8899 DPLPMTUD, as RFC 9000 section 14.3 allows).

A sans-IO state machine: it says which probe size to send and when a probe
is due, it is told what became of each probe and of the connection's
full-size packets, and ``size`` is the datagram size the connection may use.
It owns no socket and no clock: ``now`` comes in where a timer is set (the
raise timer runs from the last probe sent); the QUIC side that builds and
sends the probes is ``MeshQuicConnection`` in ``quic.py``.

The search, for a path that the handshake has shown carries ``base`` (1200)::

    BASE --start()--> SEARCHING --no candidate left--> SEARCH_COMPLETE
                        ^  |                                  |
                        |  +--black hole: back to base--+     | raise timer (600 s)
                        +-------------------------------+-----+

- Candidates: the sizes of common link MTUs (``ladder``) that lie between
  the largest size confirmed so far and ``max_size`` (the local interface's
  MTU, capped), then ``max_size`` itself, smallest first, so a path whose MTU
  is the local link's takes one round trip per step and no failure.  After
  the first failure the gap between the largest confirmed and the smallest
  failed size is halved until it is at most ``step`` bytes.
- A size is confirmed only when a probe of that size is acknowledged; it has
  failed after ``max_probes`` probes of it were lost, or at once when the
  local socket refused it (EMSGSIZE: larger than the local link).
- One probe is in flight at a time.  A probe is lost when the QUIC loss
  detection says so or when it has not been acknowledged ``timeout``
  seconds after it went out (the caller passes a few PTOs).  An
  acknowledgement that comes late still confirms its size.
- Black holes (RFC 8899 section 4.3): the packets this cares about are the
  connection's own in-flight packets larger than ``base`` and no larger than
  ``size``.  A loss event that includes one sent after the last such packet
  that was acknowledged is suspicious; ``black_hole_losses`` suspicious
  events in a row, with no such packet acknowledged in between, and the size
  drops to ``base`` and the search starts again below the size that failed.
- ICMP Packet Too Big is not used: the socket does not ask for ICMP errors,
  and the search works the same where they are filtered.
- There is no ERROR state (RFC 8899's "even BASE_PLPMTU fails"): QUIC cannot
  run below 1200 bytes, so a path that stops carrying them is left to the
  connection's idle timeout.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Iterable

BASE_PLPMTU = 1200  # QUIC's smallest datagram (RFC 9000 section 14), proven by the handshake
MAX_PROBES = 3  # RFC 8899 MAX_PROBES
RAISE_INTERVAL = 600.0  # RFC 8899 PMTU_RAISE_TIMER, seconds
SEARCH_STEP = 16  # stop halving the gap between confirmed and failed sizes at this many bytes
BLACK_HOLE_LOSSES = 3  # suspicious loss events in a row that mean a black hole
COMMON_LINK_MTUS = (1280, 1420, 1480, 1492, 1500, 9000)  # IPv6 minimum, WireGuard, 6in4, PPPoE, Ethernet, jumbo
UDP_IPV4_OVERHEAD = 20 + 8
UDP_IPV6_OVERHEAD = 40 + 8


def ladder(overhead: int, link_mtus: Iterable[int] = COMMON_LINK_MTUS) -> tuple[int, ...]:
    """The UDP payload sizes of ``link_mtus`` for a path whose IP+UDP headers take ``overhead`` bytes."""
    return tuple(sorted(mtu - overhead for mtu in link_mtus))


class State(enum.Enum):
    BASE = "base"  # using base; the search has not started
    SEARCHING = "searching"
    SEARCH_COMPLETE = "search_complete"


@dataclass(frozen=True)
class Probe:
    """One probe packet: ``number`` tells probes apart, ``size`` is the whole UDP payload."""

    number: int
    size: int


class PathMtu:
    """DPLPMTUD for one path.  ``size`` starts at ``base`` and only ever holds
    ``base`` or a size a probe has confirmed on this path."""

    def __init__(self, *, max_size: int, base: int = BASE_PLPMTU, ladder: Iterable[int] = (),
                 max_probes: int = MAX_PROBES, step: int = SEARCH_STEP,
                 raise_interval: float = RAISE_INTERVAL, black_hole_losses: int = BLACK_HOLE_LOSSES):
        if max_size < base:
            raise ValueError(f"max_size {max_size} is below the base {base}")
        self.base = base
        self.max_size = max_size
        self.size = base
        self.state = State.BASE
        self._ladder = sorted({s for s in ladder if base < s < max_size} | {max_size})
        self._max_probes = max_probes
        self._step = max(1, step)
        self._raise_interval = raise_interval
        self._black_hole_losses = black_hole_losses
        self._failed = max_size + 1  # smallest size known not to pass
        self._candidate: int | None = None
        self._attempts = 0  # probes of the candidate lost so far
        self._in_flight: Probe | None = None
        self._probe_deadline = math.inf
        self._raise_at = math.inf
        self._now = 0.0  # the latest time we were told
        self._numbers = 0
        self._large_acked = -1  # number of the last acknowledged packet larger than base
        self._suspicious = 0
        # what happened, for status and tests
        self.probes_sent = 0
        self.probes_lost = 0
        self.black_holes = 0

    def __repr__(self) -> str:
        return f"<PathMtu {self.state.value} size={self.size} max={self.max_size}>"

    # --- the search -------------------------------------------------------------

    def start(self, now: float) -> None:
        """The path carries ``base`` (the handshake showed it): start searching upward."""
        if self.state is State.BASE:
            self._now = now
            self._search()

    def probe(self, now: float, timeout: float) -> Probe | None:
        """The probe to send now, if one is due; it counts as in flight from ``now``.

        ``timeout`` is how long to wait for its acknowledgement before counting it lost.
        """
        self._now = now
        if self.state is not State.SEARCHING or self._in_flight is not None or self._candidate is None:
            return None
        self._numbers += 1
        probe = Probe(self._numbers, self._candidate)
        self._in_flight = probe
        self._probe_deadline = now + timeout
        self.probes_sent += 1
        return probe

    def probe_acked(self, probe: Probe) -> None:
        """``probe`` was acknowledged: its size passes this path (late acknowledgements count too)."""
        if self._in_flight is not None and self._in_flight.size <= probe.size:
            self._in_flight = None  # this one, or one that can tell no more
            self._probe_deadline = math.inf
        if probe.size <= self.size:
            return
        self.size = probe.size
        if self._failed <= probe.size:  # it was given up on too early: forget the failures
            self._failed = self.max_size + 1
        if self.state is not State.BASE:
            self._search()

    def probe_lost(self, probe: Probe) -> None:
        """``probe`` was declared lost (QUIC loss detection); losses of older probes are ignored."""
        if probe != self._in_flight:
            return
        self._in_flight = None
        self.probes_lost += 1
        self._attempts += 1
        if self._attempts >= self._max_probes:
            self._failed = min(self._failed, probe.size)
        self._search()

    def probe_refused(self, probe: Probe) -> None:
        """The local socket refused ``probe`` as too large (EMSGSIZE): that size fails at once."""
        if probe != self._in_flight:
            return
        self._in_flight = None
        self._failed = min(self._failed, probe.size)
        self._search()

    @property
    def deadline(self) -> float | None:
        """When ``on_timer`` is next due (a probe's timeout or the raise timer), or None."""
        when = min(self._probe_deadline, self._raise_at)
        return None if when == math.inf else when

    def on_timer(self, now: float) -> None:
        """Count an unanswered probe as lost, or search again once the raise timer is up."""
        self._now = now
        if self._in_flight is not None and now >= self._probe_deadline:
            self.probe_lost(self._in_flight)
        if self.state is State.SEARCH_COMPLETE and now >= self._raise_at:
            self._failed = self.max_size + 1  # the path may have grown: try the larger sizes again
            self._search()

    def _search(self) -> None:
        """Pick the next candidate, or finish the search (arming the raise timer if below max)."""
        if self._failed <= self.size:
            self._failed = self.max_size + 1
        candidate = self._next_candidate()
        if candidate != self._candidate:
            self._candidate, self._attempts = candidate, 0
        self._probe_deadline = math.inf if self._in_flight is None else self._probe_deadline
        if candidate is None:
            self.state = State.SEARCH_COMPLETE
            self._in_flight = None
            self._probe_deadline = math.inf
            self._raise_at = self._now + self._raise_interval if self.size < self.max_size else math.inf
        else:
            self.state = State.SEARCHING
            self._raise_at = math.inf

    def _next_candidate(self) -> int | None:
        lo, hi = self.size, self._failed
        for size in self._ladder:
            if lo < size < hi:
                return size
        if hi > self.max_size or hi - lo <= self._step:
            return None  # reached max_size, or close enough to the smallest failure
        return (lo + hi) // 2

    # --- black holes --------------------------------------------------------------

    def packet_acked(self, number: int, size: int) -> None:
        """A packet of the connection (not a probe) numbered ``number`` of ``size`` bytes was acknowledged."""
        if size > self.base and number > self._large_acked:
            self._large_acked = number
            self._suspicious = 0

    def packets_lost(self, packets: Iterable[tuple[int, int]]) -> bool:
        """One loss event: ``(number, size)`` of each lost packet (not probes).

        Returns True if this made the size fall back to ``base`` (a black hole).
        """
        if self.size <= self.base:
            return False
        if not any(self.base < size <= self.size and number > self._large_acked for number, size in packets):
            return False
        self._suspicious += 1
        if self._suspicious < self._black_hole_losses:
            return False
        self.black_holes += 1
        self._failed = self.size  # search again below what just stopped passing
        self.size = self.base
        self._suspicious = 0
        self._in_flight = None
        self._probe_deadline = math.inf
        self._search()
        return True
