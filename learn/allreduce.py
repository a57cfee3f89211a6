"""DiLoCo's outer all-reduce with no coordinator: every member that finishes
the round holds the same bits.

The round's contributors are an agreed list of members (sorted public keys;
all of them start from the same list, which the caller checks, e.g. by
sending it with each part).  Each member's pseudo-gradient, flattened
(every tensor in name order, float32), is cut by :func:`partition` into one
contiguous part per member, and member i is the *reducer* of part i:

1. every member sends part i of its vector to member i (:meth:`AllReduce.outgoing`);
2. member i reduces part i of the contributions it has, in contributor order,
   with the group's rule (``reduce(parts, weights)``, injected, so robust
   rules plug in): as soon as all have come, or at the parts deadline with
   those that have (:meth:`AllReduce.expire`), its own always among them;
3. member i sends the reduced part, with the list of contributors it used,
   to every member, which takes it as it is (:meth:`AllReduce.received_reduced`).

Each part is reduced once, by one member, and everyone else only copies it,
so who was left out of a part is decided in one place and every member that
receives all parts holds the same vector, bit for bit (a reducer sending
through a lossy codec makes ``reduce`` return the decoded values, so that it
holds what the others receive).  A part whose reducer died or stalled past
the deadline is missing (:meth:`AllReduce.missing_parts`), which this module
does not paper over: meshd takes zeros there (a reducer that died is missing
for everyone, so everyone agrees), and a member that missed a part others
have is put back by the state-hash check.  A contributor that says it left
the group (:meth:`AllReduce.left`) is not waited for: the reducers reduce
without its part as soon as the others are in, and the part it reduces is
missing at once.  A member off the list follows the
round (it takes the reduced parts and reduces nothing).  Each member sends and receives (N−1)/N
of the vector twice, as in a butterfly all-reduce.

:class:`StreamingAllReduce` is the same round for the sample-weighted mean,
with the reducer adding each part into its slice as the part's values
stream in, so it never holds the parts it is sent.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .robust import bounded

Reduce = Callable[[list[torch.Tensor], list[float]], torch.Tensor]


class AllReduceError(ValueError):
    """A peer's part is malformed, unexpected or repeated, or ``reduce`` returned a bad part."""


def partition(total: int, members: list[bytes]) -> list[tuple[int, int]]:
    """``[0, total)`` cut into ``len(members)`` contiguous (start, end) ranges
    whose sizes differ by at most one (the larger first), in member order."""
    if not members or total < 0:
        raise ValueError("an all-reduce needs at least one member and a size >= 0")
    base, extra = divmod(total, len(members))
    ranges, at = [], 0
    for i in range(len(members)):
        size = base + (i < extra)
        ranges.append((at, at + size))
        at += size
    return ranges


class AllReduce:
    """One member's side of one all-reduce of ``vector`` (1-D float32, not to
    be changed until the round is over) among ``members``.

    ``weight`` is this member's weight in the reduction (its samples, say);
    the reducers wait for parts until ``now + timeout`` (:attr:`parts_deadline`)
    and every member for reduced parts until ``now + 2 × timeout`` (:attr:`deadline`).
    A member not among ``members`` *follows* the round: it sends and reduces
    nothing (``vector`` only gives the size, :attr:`index` is None) and takes
    the reduced parts like the others, so it ends with the same bits.
    """

    def __init__(self, me: bytes, members: list[bytes], vector: torch.Tensor, *, reduce: Reduce,
                 weight: float = 1.0, now: float, timeout: float):
        if not members or list(members) != sorted(set(members)):
            raise ValueError("the members are distinct keys in sorted order")
        if not isinstance(vector, torch.Tensor) or vector.dim() != 1 or vector.dtype != torch.float32:
            raise ValueError("an all-reduce averages one float32 vector")
        if not 0 <= timeout < math.inf:
            raise ValueError("the timeout is finite and non-negative")
        self.me, self.members = me, list(members)
        self._member_set = frozenset(self.members)  # membership checks in O(1): a peer's list is checked key by key
        self.index = self.members.index(me) if me in self.members else None  # the part this member reduces
        self.ranges = partition(vector.numel(), self.members)
        self.parts_deadline = now + timeout
        self.deadline = now + 2 * timeout
        self._vector = vector
        self._reduce = reduce
        self._parts = {}  # contributor -> (part, weight), until reduced
        if self.index is not None:
            lo, hi = self.ranges[self.index]
            self._parts[me] = (vector[lo:hi], _weight(weight))
        self._reduced: dict[int, tuple[torch.Tensor, list[bytes]]] = {}  # index -> (values, contributors used)
        self._missing: list[int] | None = None  # decided at the deadline
        self._left: set[bytes] = set()  # contributors that said they left: not waited for
        if self.members == [me]:
            self._reduce_mine()

    def outgoing(self) -> list[tuple[bytes, int, torch.Tensor]]:
        """(reducer, part index, slice of the vector): what this member sends, one to each other member."""
        if self.index is None:
            return []
        return [(peer, i, self._vector[lo:hi]) for i, (peer, (lo, hi)) in enumerate(zip(self.members, self.ranges))
                if peer != self.me]

    def received_part(self, peer: bytes, index: int, tensor: torch.Tensor, weight: float = 1.0) -> bool:
        """Take contributor ``peer``'s part ``index`` for this member to reduce;
        True if taken, False if it came after the reduction (ignored).
        AllReduceError for a part this member does not reduce, a peer that is
        not a contributor, a second part from one, or a malformed part."""
        self._check_sender(peer, index)
        if self.index in self._reduced:
            return False
        if peer in self._parts:
            raise AllReduceError(f"a part from {_short(peer)} came twice")
        self._parts[peer] = (self._check(index, tensor), _weight(weight))
        self._reduce_if_all_in()
        return True

    def left(self, peer: bytes) -> bool:
        """Take it that contributor ``peer`` left the group: its part is not waited
        for (one that comes before this member reduces is still used) and the part
        it reduces is missing now.  True if this call reduced this member's part
        (it is then to be sent).  AllReduceError for a stranger or this member."""
        if peer not in self._member_set:
            raise AllReduceError(f"{_short(peer)} is not a contributor")
        if peer == self.me:
            raise AllReduceError("this member cannot leave its own round")
        if peer in self._left:
            return False
        self._left.add(peer)
        mine = self.index is not None and self.index not in self._reduced
        self._reduce_if_all_in()
        return mine and self.index in self._reduced

    def contributors_missing(self) -> list[bytes]:
        """The contributors whose part this member's reduction lacks (sorted)."""
        have = self._reduced[self.index][1] if self.index in self._reduced else self._parts
        return [m for m in self.members if m not in have]

    def expire(self, now: float) -> bool:
        """Move the round on at ``now``: past the parts deadline, reduce this
        member's part over the contributors it has; past the deadline, the parts
        not received are missing for good.  True if this call reduced (the
        reduced part is then to be sent)."""
        reducing = now >= self.parts_deadline and self.index is not None and self.index not in self._reduced
        if reducing:
            self._reduce_mine()
        if now >= self.deadline and self._missing is None:
            self._missing = [i for i in range(len(self.members)) if i not in self._reduced]
        return reducing

    def reduced(self, index: int) -> tuple[torch.Tensor, list[bytes]] | None:
        """Part ``index`` reduced and the contributors its reducer used, once
        this member has it (for its own part: what it sends to everyone)."""
        return self._reduced.get(index)

    def received_reduced(self, peer: bytes, index: int, tensor: torch.Tensor, used: list[bytes]) -> bool:
        """Take reduced part ``index`` from its reducer ``peer``; True if taken,
        False if it came after the deadline (the part stays missing).
        AllReduceError if ``peer`` does not reduce that part, for a second copy,
        or for a malformed part or ``used`` list."""
        if type(index) is not int or not 0 <= index < len(self.members):
            raise AllReduceError(f"there is no part {index}")
        if index == self.index:
            raise AllReduceError(f"part {index} is reduced by this member")
        if peer != self.members[index]:
            raise AllReduceError(f"part {index} is reduced by {_short(self.members[index])}, not {_short(peer)}")
        if self._missing is not None or peer in self._left:
            return False
        if index in self._reduced:
            raise AllReduceError(f"reduced part {index} came twice")
        tensor = self._check(index, tensor)
        if not isinstance(used, list) or not all(isinstance(u, bytes) for u in used):
            raise AllReduceError("used is a sorted list of distinct contributors' keys")
        stranger = next((u for u in used if u not in self._member_set), None)
        if stranger is not None:
            raise AllReduceError(f"{_short(stranger)} is not a contributor")
        if used != sorted(set(used)):
            raise AllReduceError("used is a sorted list of distinct contributors' keys")
        if peer not in used:
            raise AllReduceError("a reducer always uses its own part")
        self._reduced[index] = (tensor, used)
        return True

    def missing_parts(self) -> list[int]:
        """The parts that had not come by the deadline, and those whose reducer left (sorted)."""
        gone = {i for i, m in enumerate(self.members) if m in self._left and i not in self._reduced}
        return sorted(gone.union(self._missing or (), self._lost()))

    def _lost(self) -> set[int]:
        """Parts known now never to be reduced, beyond those whose reducer left."""
        return set()

    def done(self) -> bool:
        """Every part is in or will not come, or the deadline has passed."""
        return len(self._reduced) + len(self.missing_parts()) == len(self.members) or self._missing is not None

    def result(self) -> torch.Tensor | None:
        """The whole reduced vector once every part is in; None while (or because) one is not."""
        if len(self._reduced) < len(self.members):
            return None
        return torch.cat([self._reduced[i][0] for i in range(len(self.members))])

    def _reduce_if_all_in(self) -> None:
        """Reduce this member's part once every contributor that has not left has sent its own."""
        if self.index is not None and self.index not in self._reduced \
                and all(m in self._parts or m in self._left for m in self.members):
            self._reduce_mine()

    def _reduce_mine(self) -> None:
        used = [m for m in self.members if m in self._parts]
        value = self._reduce([self._parts[m][0] for m in used], [self._parts[m][1] for m in used])
        try:
            self._reduced[self.index] = (self._check(self.index, value), used)
        except AllReduceError as exc:
            raise AllReduceError(f"reduce returned a bad part: {exc}") from None
        self._parts = {}

    def _check_sender(self, peer: bytes, index: int) -> None:
        """AllReduceError unless ``peer`` is a contributor and ``index`` the part this member reduces."""
        if self.index is None:
            raise AllReduceError("this member follows the round and reduces no part")
        if index != self.index:
            raise AllReduceError(f"this member reduces part {self.index}, not part {index}")
        if peer not in self._member_set:
            raise AllReduceError(f"{_short(peer)} is not a contributor")

    def _check(self, index: int, tensor: object) -> torch.Tensor:
        lo, hi = self.ranges[index]
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or tensor.numel() != hi - lo:
            shape = list(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise AllReduceError(f"part {index} is a vector of {hi - lo} values, not {shape}")
        if tensor.dtype != torch.float32:
            raise AllReduceError(f"a part is float32, not {tensor.dtype}")
        if not bool(torch.isfinite(tensor.sum())):  # NaN or ±inf anywhere makes the sum so (as does overflow)
            raise AllReduceError(f"part {index} has values that are not finite (or too large to add)")
        return tensor


def _weight(weight: float) -> float:
    if type(weight) not in (int, float) or not 0 < weight < math.inf:
        raise AllReduceError(f"a weight is finite and positive, not {weight!r}")
    return weight


def _short(key: bytes) -> str:
    return key[:8].hex() if isinstance(key, bytes) else repr(key)


class StreamingAllReduce(AllReduce):
    """An :class:`AllReduce` whose reducer takes the sample-weighted mean of its part
    as the parts stream in, into ``into`` (a float32 vector of the vector's size; it
    may be the vector itself), instead of holding every part whole: a reducer of a
    large model then needs no memory for the parts it is sent.

    A contributor's part is *announced* with its weight (:meth:`announce`, as its
    signed head comes), streamed in with :meth:`add` and closed with
    :meth:`part_done` once it is whole.  The weights are settled (bounded
    by their median, as the mean rule does, and normalized) once every contributor
    that has not left has announced, or at the parts deadline over those that
    have; from then on announced parts are added as they come and later ones are
    refused.  The reduced part is ready when every part settled on is done.  A
    settled part that fails after some of it was added (:meth:`fail`, a bad chunk,
    not done by :attr:`reduce_by`) cannot be taken back out of the sum: this member's
    part is then missing for everyone, who agree on that as they do on a reducer
    that died.  Which bits come out depends on the order chunks arrive in; every
    member still holds the same ones, as only the reducer adds.
    """

    def __init__(self, me: bytes, members: list[bytes], vector: torch.Tensor, *, into: torch.Tensor,
                 weight: float = 1.0, now: float, timeout: float):
        if not isinstance(into, torch.Tensor) or into.dtype != torch.float32 or into.shape != vector.shape:
            raise ValueError("a streamed reduction lands in a float32 vector of the vector's shape")
        self._into = into
        self._weights: dict[bytes, float] = {}  # announced contributors -> weight
        self._scale: dict[bytes, float] | None = None  # settled: contributor -> its share of the mean
        self._have: dict[bytes, int] = {}  # values added so far, per contributor settled on
        self._done: set[bytes] = set()  # contributors settled on whose part is all in and checked
        self._whole: dict[bytes, torch.Tensor] = {}  # parts that came whole before the weights settled
        self._failed = False
        super().__init__(me, members, vector, reduce=_unused, weight=weight, now=now, timeout=timeout)
        self._own_weight()

    @property
    def settled(self) -> bool:
        """The weights are fixed: announced parts are added as they come, no more are taken."""
        return self._scale is not None

    def announce(self, peer: bytes, index: int, weight: float = 1.0) -> bool:
        """Contributor ``peer``'s part ``index`` of ``weight`` is coming; False if it
        comes too late to be counted (the weights are settled without it).  Once
        settled, a part settled on of which nothing was added may come again (sent
        another way after a first way failed).  AllReduceError as
        :meth:`received_part` says."""
        self._check_sender(peer, index)
        if self._failed or self.index in self._reduced:
            return False
        if self.settled:
            return peer in self._scale and peer not in self._done and self._have[peer] == 0
        if peer in self._weights:
            raise AllReduceError(f"a part from {_short(peer)} came twice")
        self._weights[peer] = _weight(weight)
        self._reduce_if_all_in()
        return True

    def received_part(self, peer: bytes, index: int, tensor: torch.Tensor, weight: float = 1.0) -> bool:
        """A part that came whole: announced, and added now or once the weights settle."""
        if not self.announce(peer, index, weight):
            return False
        tensor = self._check(index, tensor)
        if self.settled:
            self._add_whole(peer, tensor)
        else:
            self._whole[peer] = tensor
        return True

    def add(self, peer: bytes, at: int, values: torch.Tensor) -> None:
        """Add the next ``values`` of ``peer``'s part, which start at its value ``at``.
        AllReduceError (and this member's part is lost) for values out of order,
        past the part's end or not float32.  (A value that is not finite is found
        in the sum, once the part is reduced: it makes that so, and the part is lost.)"""
        if not self.settled or peer not in self._scale or peer in self._done or self._failed:
            raise AllReduceError(f"{_short(peer)}'s part is not being taken")
        lo, hi = self.ranges[self.index]
        have = self._have[peer]
        bad = ("out of order" if at != have else "not a float32 vector"
               if not isinstance(values, torch.Tensor) or values.dtype != torch.float32 or values.dim() != 1
               else "past the part's end" if have + values.numel() > hi - lo else None)
        if bad is not None:
            self._failed = True
            raise AllReduceError(f"values {at}+ of {_short(peer)}'s part are {bad}")
        self._into[lo + have:lo + have + values.numel()].add_(values, alpha=self._scale[peer])
        self._have[peer] = have + values.numel()

    def part_done(self, peer: bytes) -> None:
        """``peer``'s part is all in and checked; AllReduceError (and this member's
        part is lost) if it is not whole."""
        if self._failed or peer not in (self._scale or ()) or peer in self._done:
            raise AllReduceError(f"{_short(peer)}'s part is not being taken")
        if self._have[peer] != self._size():
            self._failed = True
            raise AllReduceError(f"{_short(peer)}'s part ended early")
        self._done.add(peer)
        self._reduce_if_all_in()

    def fail(self, peer: bytes) -> None:
        """``peer``'s part did not come whole, or not as signed: once some of it was
        added it cannot be taken back out, so this member's part is lost.  One
        that was not settled on yet is forgotten (it may come again)."""
        if peer == self.me:  # this member's own part is in from the start
            return
        if not self.settled:
            self._weights.pop(peer, None)
            self._whole.pop(peer, None)
        elif peer in self._scale and peer not in self._done and self._have[peer]:
            self._failed = True

    @property
    def reduce_by(self) -> float:
        """When this member's part is reduced or lost: halfway from the parts deadline to
        the deadline.  A whole-part reduction is done at the parts deadline; this one
        may wait a while longer for parts settled on, but not so long that a member
        whose round began a little earlier gives up on the part before it comes."""
        return self.parts_deadline + (self.deadline - self.parts_deadline) / 2

    def expire(self, now: float) -> bool:
        """As :meth:`AllReduce.expire`; past :attr:`reduce_by` a part settled on that is
        not done makes this member's part missing."""
        before = self.index in self._reduced
        if self.index is not None and not self._failed:
            if now >= self.parts_deadline and not self.settled:
                self._settle()
            if now >= self.reduce_by and self.index not in self._reduced:
                self._failed = True
        super().expire(now)
        return self.index is not None and not before and self.index in self._reduced

    def contributors_missing(self) -> list[bytes]:
        have = self._reduced[self.index][1] if self.index in self._reduced else self._weights
        return [m for m in self.members if m not in have]

    def _lost(self) -> set[int]:
        return {self.index} if self._failed else set()

    def _size(self) -> int:
        lo, hi = self.ranges[self.index]
        return hi - lo

    def _own_weight(self) -> None:
        if self.me in self._parts:  # the base class keeps this member's part there
            self._weights[self.me] = self._parts.pop(self.me)[1]

    def _reduce_if_all_in(self) -> None:
        if self.index is None or self.index in self._reduced or self._failed:
            return
        if not self.settled:
            if all(m in self._weights or m in self._left for m in self.members):
                self._settle()
            return
        if self._done >= self._scale.keys():
            lo, hi = self.ranges[self.index]
            value = self._into[lo:hi]
            if not bool(torch.isfinite(value.sum())):  # finite parts can still add up past float32
                self._failed = True
                return
            self._reduced[self.index] = (value, [m for m in self.members if m in self._scale])

    def _reduce_mine(self) -> None:  # the base class's call: for a member alone, and at the parts deadline
        self._own_weight()
        if not self.settled:
            self._settle()

    def _settle(self) -> None:
        """Fix the weights over the contributors announced, start the sum with this
        member's own part, and add the parts that came whole."""
        used = [m for m in self.members if m in self._weights]
        shares = bounded([self._weights[m] for m in used])
        total = float(sum(shares))
        self._scale = {m: share / total for m, share in zip(used, shares)}
        self._have = dict.fromkeys(used, 0)
        lo, hi = self.ranges[self.index]
        torch.mul(self._vector[lo:hi], self._scale[self.me], out=self._into[lo:hi])
        self._have[self.me] = hi - lo
        self._done.add(self.me)
        whole, self._whole = self._whole, {}
        for peer, tensor in whole.items():
            self._add_whole(peer, tensor)
        self._reduce_if_all_in()

    def _add_whole(self, peer: bytes, tensor: torch.Tensor) -> None:
        lo, hi = self.ranges[self.index]
        self._into[lo:hi].add_(tensor, alpha=self._scale[peer])
        self._have[peer] = hi - lo
        self._done.add(peer)
        self._reduce_if_all_in()


def _unused(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    raise AssertionError("a streamed reduction adds the parts as they come")
