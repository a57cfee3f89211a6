"""Relay reservations and circuit limits, with no I/O (libp2p circuit relay v2 roles).

A NATed **target** reserves a slot at a reachable **relay**; a dialer then
asks the relay for a circuit to the target, and the relay carries it within
the reservation's limits.  This module keeps both sides' books:

* :class:`Reservations` is the relay's table: who holds a slot, until when,
  and how many circuits each has open;
* :class:`ByteBudget` counts what one circuit carried, both ways together;
* :class:`Pacer` holds what all circuits carry together to the relay's rate;
* :class:`HeldReservations` is the target's list of relays holding a slot
  for it, and :func:`parse_limits` checks a relay's answer to ``reserve``.

Peers are opaque hashable keys (meshd passes PeerIds); ``str(peer)`` is used
only in status dicts.  Time is the caller's monotonic clock, passed as
``now`` in seconds; nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

from .errors import Malformed, Refused

RENEW_FRACTION = 0.8  # renew a reservation when this much of its ttl has passed


@dataclass(frozen=True)
class RelayLimits:
    """What a relay offers; the ``[relay]`` config section less ``reserve_at_bootstrap``.

    Per relay: whether it relays at all, how many reservations it holds, and
    the bytes per second all its circuits carry together (0: no limit).  Per
    reservation: its lifetime, and circuits open at once.  Per circuit: bytes
    carried (both directions together) and seconds open.
    """

    enabled: bool = False
    max_reservations: int = 128
    rate: float = 32 << 20
    reservation_ttl: float = 3600.0
    max_circuits: int = 16
    circuit_bytes: int = 128 << 20
    circuit_seconds: float = 600.0

    def wire(self) -> dict:
        """The limits as a relay sends them in its answer to ``reserve``."""
        return {"ttl": self.reservation_ttl, "max_circuits": self.max_circuits,
                "circuit_bytes": self.circuit_bytes, "circuit_seconds": self.circuit_seconds}


class ByteBudget:
    """Bytes one circuit may still carry; both directions draw on the one budget."""

    def __init__(self, limit: int):
        self.limit = limit
        self.carried = 0

    def carry(self, n: int) -> bool:
        """Count ``n`` more bytes; False once the total has passed the limit (close the circuit).

        Reaching the limit exactly is still allowed: only going past it closes.
        """
        self.carried += n
        return self.carried <= self.limit


class Pacer:
    """Paces the bytes all of a relay's circuits carry to ``rate`` per second on average,
    in bursts of at most one second's worth (a token bucket; ``rate`` 0: no pacing)."""

    def __init__(self, rate: float):
        self.rate = rate
        self._credit = rate  # bytes that may pass now without waiting (negative: owed)
        self._at: float | None = None  # when the credit was last brought up to date

    def wait(self, n: int, now: float) -> float:
        """Count ``n`` bytes that pass at ``now``; the seconds their sender must wait first
        (0: at once).  Each call is charged at once, so callers that wait queue up in turn."""
        if self.rate <= 0:
            return 0.0
        if self._at is not None:
            self._credit = min(self.rate, self._credit + (now - self._at) * self.rate)
        self._at = now
        self._credit -= n
        return 0.0 if self._credit >= 0 else -self._credit / self.rate


@dataclass(eq=False)
class _Reservation:
    expires: float
    circuits: int = 0


class Circuit:
    """One open circuit, counted against its reservation until :meth:`close`.

    The relay closes the circuit after ``seconds`` or once ``budget`` says no,
    whichever comes first.  Use it as a context manager, or call ``close``
    in a ``finally``.
    """

    def __init__(self, seconds: float, budget: ByteBudget, reservation: _Reservation):
        self.seconds = seconds
        self.budget = budget
        self._reservation: _Reservation | None = reservation

    def close(self) -> None:
        """Give the circuit's slot back; calling it again does nothing.

        The slot goes back to the reservation the circuit was opened under,
        even if that one has expired and the target reserved anew since, so
        a new reservation's count is never touched by an old circuit.
        """
        if self._reservation is not None:
            self._reservation.circuits -= 1
            self._reservation = None

    def __enter__(self) -> "Circuit":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Reservations:
    """The relay's side: reservations held here and the circuits open under each.

    Iterating yields the peers holding a reservation (expired ones stay
    until something calls :meth:`expire`, directly or through another method).
    """

    def __init__(self, limits: RelayLimits):
        self.limits = limits
        self._held: dict[Hashable, _Reservation] = {}

    def reserve(self, peer: Hashable, now: float) -> dict:
        """Grant or renew ``peer``'s reservation for ``reservation_ttl`` seconds from ``now``.

        Returns the limits in wire form (:meth:`RelayLimits.wire`).  A renewal
        keeps the circuits already open.  Raises Refused "disabled" when
        relaying is off, "full" when ``max_reservations`` other peers hold one.
        """
        limits = self.limits
        if not limits.enabled:
            raise Refused("disabled", "this node does not relay (set [relay] enabled = true)")
        self.expire(now)
        if peer not in self._held and len(self._held) >= limits.max_reservations:
            raise Refused("full", f"relay is full ({limits.max_reservations} reservations)")
        held = self._held.setdefault(peer, _Reservation(now))
        held.expires = now + limits.reservation_ttl
        return limits.wire()

    def open_circuit(self, target: Hashable, now: float, *, connected: bool) -> Circuit:
        """Count a new circuit to ``target``; ``connected``: the relay holds a connection to it.

        Raises Refused "no_reservation" when ``target`` holds no live
        reservation or is not connected, "busy" when it has ``max_circuits``
        open already.
        """
        self.expire(now)
        held = self._held.get(target)
        if held is None or not connected:
            raise Refused("no_reservation", f"no reservation for {target} here")
        if held.circuits >= self.limits.max_circuits:
            raise Refused("busy", f"{target} has {held.circuits} circuits open, the most allowed")
        held.circuits += 1
        return Circuit(self.limits.circuit_seconds, ByteBudget(self.limits.circuit_bytes), held)

    def expire(self, now: float) -> None:
        """Drop reservations whose lifetime ended at or before ``now``."""
        for peer in [p for p, r in self._held.items() if r.expires <= now]:
            del self._held[peer]

    def status(self, now: float) -> dict:
        """``{str(peer): {"circuits": n, "expires_in": whole seconds}}`` for live reservations."""
        self.expire(now)
        return {str(p): {"circuits": r.circuits, "expires_in": round(r.expires - now)}
                for p, r in self._held.items()}

    def __contains__(self, peer: object) -> bool:
        return peer in self._held

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._held))

    def __len__(self) -> int:
        return len(self._held)


class HeldReservations:
    """The target's side: relays holding a reservation for us, and when each expires.

    Entries are never dropped: a relay we once reserved at may still deliver a
    circuit it admitted on its own clock, so :meth:`holds` and iteration see
    expired entries too; only :meth:`status` hides them.
    """

    def __init__(self) -> None:
        self._expires: dict[Hashable, float] = {}

    def held(self, relay: Hashable, ttl: float, now: float) -> None:
        """Note that ``relay`` granted us a reservation for ``ttl`` seconds from ``now``."""
        self._expires[relay] = now + float(ttl)

    def holds(self, relay: Hashable) -> bool:
        """Whether ``relay`` has granted us a reservation (expired or not)."""
        return relay in self._expires

    def live(self, now: float) -> list[Hashable]:
        """The relays whose reservation is still live at ``now``."""
        return [r for r, t in self._expires.items() if t > now]

    def status(self, now: float) -> dict:
        """``{str(relay): whole seconds left}`` for the reservations still live at ``now``."""
        return {str(r): round(self._expires[r] - now) for r in self.live(now)}

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._expires))


def parse_limits(reply: object) -> dict:
    """Check a relay's answer to ``reserve``; returns the four limits, nothing else.

    ``ttl`` must be a finite number above zero; ``circuit_seconds`` a finite
    number, ``max_circuits`` and ``circuit_bytes`` integers, all at least zero.
    Raises Malformed otherwise, so a bad relay cannot break the renewal timer.
    """
    if not isinstance(reply, dict):
        raise Malformed("relay answered reserve with something other than a map")
    out = {}
    for key, kinds in (("ttl", (int, float)), ("max_circuits", (int,)),
                       ("circuit_bytes", (int,)), ("circuit_seconds", (int, float))):
        value = reply.get(key)
        if isinstance(value, bool) or not isinstance(value, kinds) or value < 0 or not _finite(value):
            raise Malformed(f"relay limit {key!r} is {value!r}, not a number at least 0")
        out[key] = value
    if out["ttl"] == 0:
        raise Malformed("relay granted a reservation with ttl 0")
    return out


def _finite(value: int | float) -> bool:
    return isinstance(value, int) or math.isfinite(value)


def renew_after(ttl: float) -> float:
    """Seconds until a reservation of ``ttl`` seconds should be renewed (before it lapses)."""
    return float(ttl) * RENEW_FRACTION
