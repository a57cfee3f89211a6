"""The iterative lookup as a state machine (sans-IO).

The caller asks :meth:`Lookup.next_queries` whom to ask, sends FIND_NODE (or
GET_VALUE, GET_PROVIDERS) to them, and reports each answer with
:meth:`Lookup.answered` or :meth:`Lookup.failed`.  At most ``alpha`` queries
are in flight, always to the nearest contacts not yet asked.

The stop rule is the one go-libp2p's DHT uses: the lookup is finished when
the ``beta`` nearest contacts it knows of that have not failed have all
answered.  The nearest nodes know their neighbourhood best, so by then the
``k`` nearest known contacts are the answer; there is no fixed number of
rounds.  A query overdue (:meth:`Lookup.slow`, the caller's clock decides)
gives up its slot to the next nearest contact and stops counting among the
nearest until it answers, so a dead node does not hold the lookup for its
whole timeout.  ``beta = k`` gives the stricter rule of the Kademlia paper
(every result has answered) at the cost of more round trips.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .ids import Contact

NEW, WAITING, SLOW, ANSWERED, FAILED = "new", "waiting", "slow", "answered", "failed"


@dataclass
class Candidate:
    contact: Contact
    distance: int
    hop: int  # queries on the path that found it: 0 for our own table
    state: str = NEW


class Lookup:
    """Finds the ``k`` contacts closest to ``target``, starting from ``seeds``,
    once the ``beta`` closest have answered.

    ``exclude`` (our own public key) is never added.  ``max_queries`` bounds
    the work one lookup may cause, whatever peers answer.
    """

    def __init__(self, target: bytes, seeds: list[Contact], *, k: int = 20, alpha: int = 3,
                 beta: int = 3, exclude: bytes | None = None, max_queries: int = 400):
        self.target = target
        self.k = k
        self.beta = min(beta, k)
        self.alpha = alpha
        self.max_queries = max_queries
        self._target_num = int.from_bytes(target, "big")
        self._exclude = exclude
        self._by_key: dict[bytes, Candidate] = {}
        self._order: list[tuple[int, bytes]] = []  # (distance, public key), nearest first
        self.in_flight = 0
        self.queries = 0
        self.stopped = False
        self._add(seeds, hop=0)

    def _add(self, contacts: list[Contact], hop: int) -> None:
        for contact in contacts:
            pk = contact.public_key
            if pk == self._exclude or pk in self._by_key:
                continue
            d = contact.num ^ self._target_num
            self._by_key[pk] = Candidate(contact, d, hop)
            bisect.insort(self._order, (d, pk))

    def _live(self):
        """Candidates that have not failed and are not overdue, nearest first."""
        for _, pk in self._order:
            candidate = self._by_key[pk]
            if candidate.state != FAILED and candidate.state != SLOW:
                yield candidate

    def next_queries(self) -> list[Contact]:
        """Contacts to query now (each is marked as waiting); empty when
        nothing should be sent until an answer arrives, or when finished."""
        if self.stopped:
            return []
        out = []
        seen = 0
        for candidate in self._live():
            if seen == self.k or self.in_flight >= self.alpha or self.queries >= self.max_queries:
                break
            seen += 1
            if candidate.state == NEW:
                candidate.state = WAITING
                self.in_flight += 1
                self.queries += 1
                out.append(candidate.contact)
        return out

    def answered(self, contact: Contact, closer: list[Contact]) -> None:
        """``contact`` answered, naming ``closer`` contacts."""
        candidate = self._settle(contact, ANSWERED)
        if candidate is not None:
            self._add(closer, candidate.hop + 1)

    def failed(self, contact: Contact) -> None:
        """``contact`` timed out or gave an unusable answer."""
        self._settle(contact, FAILED)

    def slow(self, contact: Contact) -> None:
        """``contact`` is overdue: its query no longer holds one of the ``alpha``
        slots, and it is left out of the nearest until it answers (it may
        still: :meth:`answered` and :meth:`failed` take it back)."""
        candidate = self._by_key.get(contact.public_key)
        if candidate is not None and candidate.state == WAITING:
            candidate.state = SLOW
            self.in_flight -= 1

    def overdue(self) -> list[Contact]:
        """Contacts whose queries are overdue and have not answered yet."""
        return [c.contact for c in self._by_key.values() if c.state == SLOW]

    def _settle(self, contact: Contact, state: str) -> Candidate | None:
        candidate = self._by_key.get(contact.public_key)
        if candidate is None or candidate.state not in (WAITING, SLOW):
            return None
        if candidate.state == WAITING:
            self.in_flight -= 1
        candidate.state = state
        return candidate

    def stop(self) -> None:
        """End the lookup early (a value lookup that has what it needs)."""
        self.stopped = True

    @property
    def finished(self) -> bool:
        """True when stopped, when the ``beta`` nearest live candidates have
        all answered, or when the query budget is spent and nothing is in flight."""
        if self.stopped:
            return True
        if all(c.state == ANSWERED for c in self._top(self.beta)):
            return True
        return self.queries >= self.max_queries and not self.in_flight

    def _top(self, count: int) -> list[Candidate]:
        return [c for _, c in zip(range(count), self._live())]

    def closest(self, count: int | None = None) -> list[Contact]:
        """The nearest contacts known that have not failed, nearest first
        (the ``beta`` nearest have answered when the lookup finished normally)."""
        return [c.contact for c in self._top(self.k if count is None else count)]

    def answered_closest(self, count: int | None = None) -> list[Contact]:
        """The nearest contacts that answered, nearest first."""
        out = [c.contact for c in self._live() if c.state == ANSWERED]
        return out[: self.k if count is None else count]

    def hops(self) -> int:
        """Queries on the longest path to one of the ``beta`` nearest contacts
        that ended the lookup (0 if none answered)."""
        return max((c.hop + 1 for c in self._top(self.beta) if c.state == ANSWERED), default=0)
