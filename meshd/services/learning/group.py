"""One training group as this member sees it: who is live, and tensor exchange.

:class:`Group` is the trio shell over :mod:`learn`'s membership view
(:class:`learn.group.GroupView`), its adaptive timeouts
(:class:`learn.group.RoundClock`), the wire format (:mod:`learn.wire`) and
the all-reduce's partition (:mod:`learn.allreduce`).  The algorithms
(``averager.py``, ``diloco.py``) call :meth:`Group.pull` and
:meth:`Group.allreduce`; the service routes peers' calls to the ``serve_*``
methods.  Every set of tensors a peer sends is checked against the signed
contribution that heads it, and counted in :attr:`Group.bytes_in`.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field as dc_field
from typing import AsyncIterator, Callable

import trio

from learn.allreduce import partition
from learn.group import GroupView, RoundClock
from learn.wire import Contribution, Decoder, Limits, WireError, digest_of, frames

from ...identity import PeerId
from ...rpc import InvalidArgument, NotFound, PermissionDenied, RpcError, Unavailable
from ...rpc.args import field
from ...service import Host
from .config import LearningSection

log = logging.getLogger("meshd.learning")

KEEP_REDUCTIONS = 4  # finished all-reduce slices kept for late pullers
_HELLO_MEMBERS = 32  # other members one hello names


@dataclass
class Offer:
    """A set of tensors this member offers to ``learning.pull``, signed once."""

    contribution: Contribution
    signature: bytes
    named: list  # [(name, Encoded)]


@dataclass
class Reduction:
    """This member's slice of one all-reduce, as its reducer."""

    members: list[bytes]  # the contributors expected (sorted keys)
    size: int  # values in the slice
    codec: str
    reduce: Callable  # (tensors, weights) -> (tensor, clipped indices)
    received: dict[bytes, tuple] = dc_field(default_factory=dict)  # contributor -> (tensor, samples)
    complete: trio.Event = dc_field(default_factory=trio.Event)  # every member's slice is in
    done: trio.Event = dc_field(default_factory=trio.Event)
    result: Offer | None = None
    used: list[bytes] = dc_field(default_factory=list)


class Group:
    """This member's side of group ``name``."""

    def __init__(self, host: Host, config: LearningSection, name: str, *, algorithm: str, rule: str):
        self._host = host
        self._config = config
        self.name, self.algorithm, self.rule = name, algorithm, rule
        self.me = self._host.peer_id.key
        self.view = GroupView(self.me, heartbeat_interval=config.heartbeat_interval,
                              min_timeout=3 * config.heartbeat_interval)
        self.clock = RoundClock(floor=config.round_timeout_min, ceiling=config.round_timeout_max)
        self.limits = Limits(max_bytes=config.max_bytes)
        self.round = 0  # the round this member works on
        self.joined = 0  # the first round it contributes to
        self.hash: bytes | None = None  # blake3 of the shared state after round hash_round
        self.hash_round = -1
        self.bytes_in: Counter = Counter()  # peer key -> bytes received
        self.bytes_out: Counter = Counter()
        self.samples: Counter = Counter()  # peer key -> samples contributed, last round it did
        self.clipped: Counter = Counter()  # peer key -> rounds its contribution was clipped
        self.cancel_scope = trio.CancelScope()
        self.wake = trio.Event()  # greet now rather than at the next heartbeat
        self.settled = trio.Event()  # the first discovery and greeting are done
        self._heard = trio.Event()  # set (and renewed) by every hello taken in
        self._heard_of: set[bytes] = set()  # named by the DHT or a hello, not heard from yet
        self._offers: dict[str, Offer] = {}
        self._reductions: dict[tuple, Reduction] = {}
        self._reducing = trio.Event()  # set (and renewed) whenever this member starts reducing a slice

    # --- membership ---------------------------------------------------------------------

    def hello(self) -> dict:
        """What this member tells others about itself."""
        now = trio.current_time()
        return {"group": self.name, "round": self.round, "joined": self.joined,
                "hash": self.hash, "hash_round": self.hash_round,
                "members": [m for m in self.view.live(now) if m != self.me][:_HELLO_MEMBERS]}

    def heard_of(self, peer: bytes) -> None:
        """Note ``peer`` as a possible member, to be greeted."""
        if peer != self.me and peer not in self.view.members:
            self._heard_of.add(peer)

    def hello_from(self, peer: PeerId, info: object) -> None:
        """Take in ``peer``'s hello (its request or its reply to ours)."""
        if not isinstance(info, dict):
            raise InvalidArgument("a hello is a map")
        if len(self.view.members) >= self._config.max_members and peer.key not in self.view.members:
            return
        try:
            self.view.heard(peer.key, info, trio.current_time())
        except ValueError as exc:
            raise InvalidArgument(f"bad hello: {exc}") from None
        self._heard_of.discard(peer.key)
        self._heard.set()
        self._heard = trio.Event()
        others = info.get("members")
        if isinstance(others, list):
            for other in others[:_HELLO_MEMBERS]:
                if isinstance(other, bytes) and len(other) == 32:
                    self.heard_of(other)

    def to_greet(self) -> list[bytes]:
        """The members and possible members to say hello to this heartbeat."""
        live = self.view.live(trio.current_time())
        return sorted({*live, *self._heard_of} - {self.me})

    async def greet(self, peer: PeerId) -> None:
        """Say hello to ``peer``; a peer that does not answer is not heard from."""
        try:
            with trio.fail_after(self.clock.floor):
                reply = await self._host.rpc.call(peer, "learning.hello", self.hello())
            self.hello_from(peer, reply)
        except (RpcError, trio.TooSlowError, OSError) as exc:
            log.debug("group %s: no hello from %s: %s", self.name, peer.short(), exc)
            if isinstance(exc, NotFound):
                self._heard_of.discard(peer.key)
                self.view.drop(peer.key)

    def live(self) -> list[bytes]:
        """The members heard from lately, this one included (sorted keys)."""
        return sorted({*self.view.live(trio.current_time()), self.me})

    def best_member(self) -> bytes:
        """The live member furthest ahead (the lowest key among equals): where a
        joining member takes its state from."""
        rounds = {k: m.round for k, m in self.view.members.items() if k in self.live()}
        rounds[self.me] = self.round
        return min(rounds, key=lambda k: (-rounds[k], k))

    async def dissent(self, wait: float) -> bytes | None:
        """A member holding the majority's state hash if ours differs from it, else None.

        Waits (up to ``wait`` seconds) until every live member has said its hash
        for our round, then counts the hashes of that round, ours included."""
        def hashes() -> dict[bytes, bytes | None]:
            live = self.live()
            found = {k: m.hash for k, m in self.view.members.items()
                     if k in live and m.hash_round == self.hash_round}
            found[self.me] = self.hash
            return found

        with trio.move_on_after(wait):
            while len(hashes()) < len(self.live()):
                await self._heard.wait()
        votes = Counter(h for h in hashes().values() if h is not None)
        if not votes:
            return None
        (top, count), = votes.most_common(1)
        if self.hash == top or count <= sum(votes.values()) - count:
            return None  # we agree, or there is no majority to follow
        return min(k for k, h in hashes().items() if h == top)

    def contributors(self, round: int) -> list[bytes]:
        """The members expected to contribute to ``round`` (sorted keys)."""
        return sorted({*self.view.eligible(round, trio.current_time()), self.me})

    # --- offering and pulling tensor sets ------------------------------------------------

    def _sign(self, round: int, kind: str, named: list, samples: int) -> Offer:
        contribution = Contribution(group=self.name, round=round, author=self.me, kind=kind,
                                    samples=samples, digest=digest_of(named))
        return Offer(contribution, contribution.sign(self._host.identity.sign), named)

    def offer(self, kind: str, round: int, named: list, samples: int = 0) -> None:
        """Offer ``named`` ((name, Encoded) pairs) to ``learning.pull`` of ``kind``."""
        self._offers[kind] = self._sign(round, kind, named, samples)

    async def serve_pull(self, peer: PeerId, kind: str) -> AsyncIterator[dict]:
        offer = self._offers.get(kind)
        if offer is None:
            raise Unavailable(f"no {kind} offered in group {self.name!r} yet")
        async for item in self._send(peer, offer):
            yield item

    async def pull(self, peer: PeerId, kind: str, *, timeout: float) -> tuple[Contribution, list]:
        """``peer``'s offer of ``kind``: its signed contribution and (name, Encoded) pairs.

        Raises RpcError (or trio.TooSlowError past ``timeout``) if the peer
        does not deliver, InvalidArgument if what it sends is malformed or
        its signature or digest does not check."""
        with trio.fail_after(timeout):
            async with self._host.rpc.stream(peer, "learning.pull", {"group": self.name, "kind": kind}) as items:
                return await self._receive(peer, items, kind=kind)

    # --- the all-reduce ----------------------------------------------------------------------

    async def allreduce(self, key: tuple, flat, *, samples: int, codec: str, block: int,
                        encode: Callable, decode: Callable, reduce: Callable,
                        ) -> tuple[object, object, list[tuple[int, int]], set[bytes]]:
        """Average ``flat`` (a float32 vector) with the round's other contributors.

        The vector is cut into one slice per contributor (:func:`learn.allreduce.partition`
        of the sorted contributor keys); each contributor reduces its slice of
        everyone's vector with ``reduce`` and sends the result, so every member
        gets each slice's one reduction.  ``encode``/``decode`` apply the codec;
        ``key`` names the exchange (round, fragment).  Returns the averaged
        vector, what the others received of ``flat`` (decoded: the caller keeps
        the difference as error feedback), the (start, end) ranges that could
        not be had (zeros there), and the contributors some reducer used.
        """
        import torch

        started = trio.current_time()
        members = self.contributors(key[0])
        ranges = partition(flat.numel(), members)
        mine = members.index(self.me)
        start, end = ranges[mine]
        reduction = self._reduction(key, members, end - start, codec, reduce)
        out = torch.zeros_like(flat)
        sent = torch.zeros_like(flat)
        missing: list[tuple[int, int]] = []
        used_by_any: set[bytes] = set()
        timeout = self.clock.timeout()

        async def send(index: int) -> None:
            lo, hi = ranges[index]
            named = [("slice", encode(flat[lo:hi]))]
            sent[lo:hi] = decode(named[0][1])
            if members[index] == self.me:
                self._take_part(reduction, self.me, sent[lo:hi].clone(), samples)
                return
            offer = self._sign(key[0], f"part:{key[1]}:{index}", named, samples)
            head = {"group": self.name, "key": list(key), "index": index, "members": members}
            try:
                with trio.fail_after(timeout):
                    await self._host.rpc.client_stream(
                        PeerId(members[index]), "learning.part",
                        self._items(PeerId(members[index]), offer, head), timeout=None)
            except (RpcError, trio.TooSlowError, OSError) as exc:
                log.info("group %s: slice %d to %s failed: %s", self.name, index,
                         PeerId(members[index]).short(), exc)

        async def fetch(index: int) -> None:
            lo, hi = ranges[index]
            try:
                if members[index] == self.me:
                    await reduction.done.wait()
                    offer = reduction.result
                    used = reduction.used
                    tensor = decode(offer.named[0][1])
                else:
                    with trio.fail_after(2 * timeout):
                        arg = {"group": self.name, "key": list(key), "index": index}
                        async with self._host.rpc.stream(PeerId(members[index]), "learning.reduced", arg) as items:
                            contribution, named, used = await self._receive(
                                PeerId(members[index]), items, kind=f"reduced:{key[1]}:{index}", with_used=True)
                    tensor = decode(named[0][1])
                if tensor.numel() != hi - lo:
                    raise InvalidArgument(f"slice {index} has {tensor.numel()} values, not {hi - lo}")
                out[lo:hi] = tensor
                used_by_any.update(used)
            except (RpcError, trio.TooSlowError, OSError) as exc:
                log.info("group %s: no reduced slice %d from %s: %s", self.name, index,
                         PeerId(members[index]).short(), exc)
                missing.append((lo, hi))

        async def reduce_mine() -> None:
            with trio.move_on_after(timeout):
                await reduction.complete.wait()
            self._finish(key, reduction, encode, decode)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reduce_mine)
            for index in range(len(members)):
                nursery.start_soon(send, index)
                nursery.start_soon(fetch, index)
        self.clock.observe(trio.current_time() - started)
        return out, sent, sorted(missing), used_by_any

    def _reduction(self, key: tuple, members: list[bytes], size: int, codec: str, reduce: Callable) -> Reduction:
        reduction = self._reductions.get(key)
        if reduction is None or reduction.reduce is None or reduction.members != members:
            early = reduction.received if reduction is not None else {}
            reduction = self._reductions[key] = Reduction(members, size, codec, reduce)
            for peer, (tensor, samples) in early.items():  # slices that came before we did
                if peer in members and tensor.numel() == size:
                    self._take_part(reduction, peer, tensor, samples)
            self._reducing.set()
            self._reducing = trio.Event()
        while len(self._reductions) > KEEP_REDUCTIONS:
            del self._reductions[min(self._reductions)]
        return reduction

    def _take_part(self, reduction: Reduction, peer: bytes, tensor, samples: int) -> None:
        if reduction.done.is_set() or peer in reduction.received:
            return
        reduction.received[peer] = (tensor, samples)
        if all(m in reduction.received for m in reduction.members):
            reduction.complete.set()

    def _finish(self, key: tuple, reduction: Reduction, encode: Callable, decode: Callable) -> None:
        """Reduce the slices that came, in contributor order, and offer the result."""
        used = [m for m in reduction.members if m in reduction.received]
        tensors = [reduction.received[m][0] for m in used]
        weights = [max(1, reduction.received[m][1]) for m in used]
        value, clipped = reduction.reduce(tensors, weights)
        for index in clipped:
            self.clipped[used[index]] += 1
        for member in used:
            self.samples[member] = reduction.received[member][1]
        reduction.used = used
        reduction.result = self._sign(key[0], f"reduced:{key[1]}:{reduction.members.index(self.me)}",
                                      [("slice", encode(value))], 0)
        reduction.done.set()

    async def serve_part(self, peer: PeerId, head: object, items) -> dict:
        """Take ``peer``'s slice for an all-reduce this member reduces."""
        key = tuple(field(head, "key", list))
        members = field(head, "members", list)
        index = field(head, "index", int)
        if len(key) != 2 or not all(isinstance(k, int) for k in key):
            raise InvalidArgument("key is [round, fragment]")
        if key[0] < self.round - 1:
            raise Unavailable(f"round {key[0]} is over here (round {self.round})")
        if peer.key not in members or members[index:index + 1] != [self.me]:
            raise PermissionDenied("this member does not reduce that slice for you")
        contribution, named = await self._receive(peer, items, kind=f"part:{key[1]}:{index}", round=key[0])
        from learn.compress import decode  # noqa: PLC0415  (torch only where tensors are)

        tensor = decode(named[0][1])
        reduction = self._reductions.get(key)
        if reduction is None:  # it came before we reached the round: keep it for then
            reduction = self._reductions[key] = Reduction(sorted(members), tensor.numel(), named[0][1].codec,
                                                          reduce=None)
            reduction.received[peer.key] = (tensor, contribution.samples)
            return {"early": True}
        if tensor.numel() != reduction.size:
            raise InvalidArgument(f"the slice has {tensor.numel()} values, not {reduction.size}")
        self._take_part(reduction, peer.key, tensor, contribution.samples)
        return {"ok": True}

    async def serve_reduced(self, peer: PeerId, arg: object) -> AsyncIterator[dict]:
        key = tuple(field(arg, "key", list))
        reduction = self._reductions.get(key)
        deadline = self.clock.timeout() * 2
        with trio.move_on_after(deadline):
            while reduction is None or reduction.reduce is None:
                await self._reducing.wait()
                reduction = self._reductions.get(key)
        if reduction is None or reduction.reduce is None:
            raise Unavailable(f"this member has not reached exchange {list(key)}")
        with trio.move_on_after(deadline):
            await reduction.done.wait()
        if reduction.result is None:
            raise Unavailable(f"exchange {list(key)} is not reduced here yet")
        async for item in self._send(peer, reduction.result, used=reduction.used):
            yield item

    # --- moving signed tensor sets -----------------------------------------------------------

    async def _send(self, peer: PeerId, offer: Offer, **extra) -> AsyncIterator[dict]:
        yield {"contribution": offer.contribution.to_wire(), "signature": offer.signature, **extra}
        for frame in frames(offer.named):
            self.bytes_out[peer.key] += len(frame.get("c", b""))
            yield frame

    async def _items(self, peer: PeerId, offer: Offer, head: dict) -> AsyncIterator[dict]:
        yield head
        async for item in self._send(peer, offer):
            yield item

    async def _receive(self, peer: PeerId, items, *, kind: str, round: int | None = None,
                       with_used: bool = False):
        """Read a signed tensor set from ``items``; InvalidArgument unless it is
        ``peer``'s, of ``kind`` (and ``round``), whole and matching its digest."""
        head = await anext(items, None)
        try:
            contribution = Contribution.from_wire(field(head, "contribution", dict))
            signature = field(head, "signature", bytes)
            if contribution.author != peer.key or not contribution.verify(signature, _verify):
                raise InvalidArgument("the contribution is not signed by its sender")
            if contribution.group != self.name or contribution.kind != kind:
                raise InvalidArgument(f"expected {kind} of group {self.name!r}")
            if round is not None and contribution.round != round:
                raise InvalidArgument(f"expected round {round}, not {contribution.round}")
            decoder = Decoder(self.limits)
            named: list = []
            async for frame in items:
                self.bytes_in[peer.key] += len(frame.get("c", b"")) if isinstance(frame, dict) else 0
                named += decoder.feed(frame)
            decoder.finish()
            if digest_of(named) != contribution.digest:
                raise InvalidArgument("the tensors do not match the signed digest")
        except (WireError, ValueError) as exc:
            raise InvalidArgument(f"bad tensor set from {peer.short()}: {exc}") from None
        if with_used:
            used = head.get("used")
            if not isinstance(used, list) or not all(isinstance(u, bytes) for u in used):
                raise InvalidArgument("a reduced slice names the contributors it used")
            return contribution, named, used
        return contribution, named


def _verify(public_key: bytes, signature: bytes, data: bytes) -> bool:
    return PeerId(public_key).verify(signature, data)
