"""AutoNAT decisions, with no I/O: can strangers reach this node?

Three roles.  The **asking** node N sends ``autonat.request`` to a connected
peer A, naming the peers it sent to lately (``exclude``: its NAT would let
them in, so their dial-back would prove nothing).  A picks up to
:data:`MAX_HELPERS` other peers (:func:`choose_helpers`) and asks each in turn
to ``autonat.dial_back`` the address A observed N at.  The **helper** B
refuses when it is connected to N or exchanged packets with that address
lately (:func:`dial_back_check`).  N keeps the outcome in a :class:`Verdict`.

Only the address A itself observed is ever dialed, so the service cannot aim
traffic at third parties, and A serves each requester one dial-back per
:data:`REQUEST_INTERVAL` (:class:`PerPeerInterval`).

Peers are opaque hashable keys; the wire carries ``str(peer)``.  Time is the
caller's clock, passed as ``now``; randomness comes from an injected
``random.Random``.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable, Mapping

from .errors import Malformed, Refused

REQUEST_INTERVAL = 10.0  # seconds between requests served for one peer
DIAL_TIMEOUT = 5.0  # seconds a helper spends on one dial-back
MAX_HELPERS = 3  # third peers tried per request
MAX_EXCLUDED = 256  # peers a requester may rule out as helpers
RECENT_CONTACT = 180.0  # seconds a NAT may keep a filter entry after traffic stops
VERDICT_TRIES = 8  # checks (backing off 1 s .. 60 s) before waiting for an address change
FIRST_DELAY = 1.0
MAX_DELAY = 60.0

# What a third party's dial-back says about the NAT's filtering (RFC 4787 terms).
FILTERING = {
    "public": "endpoint-independent (strangers reach us)",
    "private": "address-dependent or stricter",
    "unknown": None,
}


class PerPeerInterval:
    """One served request per ``interval`` seconds for each peer.

    :meth:`check` and :meth:`record` are separate so that a request can count
    against the budget only once it cost something (AutoNAT records a request
    only when a dial-back was made); :meth:`admit` does both at once.
    """

    def __init__(self, interval: float, what: str = "request"):
        self.interval = interval
        self.what = what
        self._last: dict[Hashable, float] = {}

    def check(self, peer: Hashable, now: float) -> None:
        """Raise Refused "too_soon" if ``peer`` was recorded less than ``interval`` ago."""
        last = self._last.get(peer)
        if last is not None and now - last < self.interval:
            raise Refused("too_soon", f"one {self.what} per {self.interval:g} s")

    def record(self, peer: Hashable, now: float) -> None:
        """Count a request from ``peer`` at ``now``.

        Entries at least ``interval`` old can no longer refuse anything and are
        dropped here, so the table holds only peers seen within one interval.
        """
        self._last = {p: t for p, t in self._last.items() if now - t < self.interval}
        self._last[peer] = now

    def admit(self, peer: Hashable, now: float) -> None:
        """:meth:`check`, then :meth:`record`: a refused request is not counted."""
        self.check(peer, now)
        self.record(peer, now)


def parse_exclude(arg: object) -> set[str]:
    """The peers (as text) a requester rules out as helpers; at most :data:`MAX_EXCLUDED`.

    A request that is not a map, or has no ``exclude``, excludes nobody.
    Raises Malformed when ``exclude`` is not a list of strings.
    """
    if not isinstance(arg, dict) or "exclude" not in arg:
        return set()
    names = arg["exclude"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names[:MAX_EXCLUDED]):
        raise Malformed('expected {"exclude": [PEERID, ...]}')
    return set(names[:MAX_EXCLUDED])


def choose_helpers(connected: Iterable[Hashable], requester: Hashable, excluded: set[str],
                   rng: random.Random) -> list[Hashable]:
    """Up to :data:`MAX_HELPERS` peers to ask for a dial-back, in the order to try them.

    Never the requester, never a peer whose ``str()`` the requester excluded;
    a uniformly random choice among the rest.
    """
    helpers = [p for p in connected if p != requester and str(p) not in excluded]
    rng.shuffle(helpers)
    return helpers[:MAX_HELPERS]


def parse_dial_back(arg: object) -> tuple[str, str]:
    """``(peer_text, addr_text)`` from a dial-back request; the shell parses each.

    Raises Malformed unless ``arg`` is ``{"peer": str, "addr": str}``.
    """
    if not isinstance(arg, dict) or not isinstance(arg.get("peer"), str) or not isinstance(arg.get("addr"), str):
        raise Malformed('expected {"peer": PEERID, "addr": HOST:PORT}')
    return arg["peer"], arg["addr"]


def reachable_of(result: object) -> bool | None:
    """A helper's answer to ``dial_back``: whether the dial reached the target, or None if malformed.

    The asked peer tries its next helper on None, and counts the request
    against the requester's interval only on a bool.
    """
    if isinstance(result, dict) and isinstance(result.get("reachable"), bool):
        return result["reachable"]
    return None


def dial_back_check(target_connected: bool, talked_recently: bool) -> None:
    """Refuse a dial-back whose success would not show that strangers reach the target.

    Raises Refused "pointless" when this helper is connected to the target,
    or exchanged packets with the address lately: the target's NAT would let
    it in either way.
    """
    if target_connected:
        raise Refused("pointless", "already connected to that peer: a dial-back would prove nothing")
    if talked_recently:
        raise Refused("pointless", "we exchanged packets with that address lately: a dial-back would prove nothing")


def contacted(dialed: Mapping[Hashable, float], connected: Iterable[Hashable], now: float) -> list[str]:
    """The ``exclude`` list: peers dialed less than :data:`RECENT_CONTACT` ago, then connected ones.

    As text, without repeats, first-seen order, at most :data:`MAX_EXCLUDED`.
    """
    recent = [p for p, when in dialed.items() if now - when < RECENT_CONTACT]
    return [str(p) for p in dict.fromkeys([*recent, *connected])][:MAX_EXCLUDED]


def backoff_delays() -> list[float]:
    """Pauses after each of the :data:`VERDICT_TRIES` checks that found no verdict.

    1 s, doubling, at most 60 s: peers (or a third peer for them) may still
    be coming.  After the last one the asker waits for its address to change.
    """
    delays, delay = [], FIRST_DELAY
    for _ in range(VERDICT_TRIES):
        delays.append(delay)
        delay = min(delay * 2, MAX_DELAY)
    return delays


class Verdict:
    """What the asking node knows of its reachability.

    ``status`` is "unknown" until a well-formed reply arrives, then "public"
    (a stranger reached us) or "private"; ``address`` is the address that
    was dialed back and ``via`` the helper that dialed, both as text.
    """

    def __init__(self) -> None:
        self.status = "unknown"
        self.address: str | None = None
        self.via: str | None = None

    @property
    def filtering(self) -> str | None:
        """What the status says about the NAT's filtering (:data:`FILTERING`)."""
        return FILTERING[self.status]

    def apply(self, reply: object) -> bool | None:
        """Take a helper's verdict as relayed by the asked peer.

        Returns True if ``status`` changed, False if not, and None (changing
        nothing) for a malformed reply: not ``{"reachable": bool,
        "address": str, "via": str}``; the asker then tries the next peer.
        """
        if not (isinstance(reply, dict) and isinstance(reply.get("reachable"), bool)
                and isinstance(reply.get("address"), str) and isinstance(reply.get("via"), str)):
            return None
        status = "public" if reply["reachable"] else "private"
        changed = status != self.status
        self.status, self.address, self.via = status, reply["address"], reply["via"]
        return changed
