"""One training group as this member sees it: who is live, and tensor exchange.

:class:`Group` is the trio shell over :mod:`learn`'s membership view
(:class:`learn.group.GroupView`), its adaptive timeouts
(:class:`learn.group.RoundClock`), the wire format (:mod:`learn.wire`) and
the all-reduce (:class:`learn.allreduce.AllReduce`), whose contributors each
round are agreed first (:meth:`Group.roster`).  The algorithms
(``averager.py``, ``diloco.py``) call :meth:`Group.pull` and
:meth:`Group.allreduce`; the service routes peers' calls to
:meth:`Group.roster` and the ``serve_*`` methods.  Every set of tensors a
peer sends is checked against the signed contribution that heads it, and
counted in :attr:`Group.bytes_in`.  Torch is imported only by the methods
that touch tensors, so a daemon starts without it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, field as dc_field
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

import trio

from learn.encoded import CodecError
from learn.group import HASH_HISTORY, GroupView, RoundClock, majority, state_source
from learn.membership import suspect
from learn.wire import (
    CHUNK, Contribution, Decoder, Into, Limits, WireError, chunk_counts, digest_of, frames, header, roster_digest,
    subset_bits, subset_of,
)

from ...identity import PeerId
from ...lane import LaneError
from ...rpc import InvalidArgument, NotFound, PermissionDenied, RpcError, Unavailable
from ...rpc.args import field
from ...service import Host, StateStore
from .bulk import NO_LANE, Bulk, Loan
from .config import LearningSection

if TYPE_CHECKING:
    from learn.allreduce import AllReduce

log = logging.getLogger("meshd.learning")

KEEP_ROUNDS = 4  # all-reduces and rosters kept (the latest), and how far from its own round a member answers
NOT_CURRENT = "is not current here"  # how a member refuses a round too far from its own: "round R ..."
OVER = "is over here"  # ... and one it is done with, or went past without taking part: "round R ..."
_HELLO_MEMBERS = 32  # other members one hello names
STATE_PROVIDERS = 3  # members a joining member asks for the state it takes over shard sync (the best one included)
STALL_REACH = 3  # dead-after spans of silence a stall of this process may explain (its hellos unread)


@dataclass
class Offer:
    """A set of tensors this member offers to ``learning.pull``, signed once."""

    contribution: Contribution
    signature: bytes
    named: list  # [(name, Encoded)]
    readers: int = 0  # sends of it under way (learning.reduced)


@dataclass
class Shared:
    """This member's state as it published it as a shards model (for members that join)."""

    version: object  # what the state source said of the state (reused while it says the same)
    round: int
    hash: bytes
    model: bytes  # the shards model id


@dataclass
class Exchange:
    """One all-reduce (round, fragment) as this member sees it."""

    key: tuple[int, int]
    core: AllReduce | None = None  # while this member is in the round
    over: bool = False  # this member is done with the round (only the signed reduced slice is kept)
    roster: list = dc_field(default_factory=list)  # the round's contributors
    early: dict = dc_field(default_factory=dict)  # peer -> (roster digest, index, part, samples) before the core
    samples: dict = dc_field(default_factory=dict)  # contributor -> samples, as its part said
    streaming: bool = False  # this member's slice is reduced as the parts stream in (StreamingAllReduce)
    encode_reduced: Callable | None = None  # the reduced slice as the others receive it (and it becomes that)
    started: trio.Event = dc_field(default_factory=trio.Event)  # this member is in the round (``core`` is set)
    settled: trio.Event = dc_field(default_factory=trio.Event)  # streamed parts may be added (the weights are fixed)
    clipped: list = dc_field(default_factory=list)  # indices (into the used list) the rule clipped
    used: list = dc_field(default_factory=list)  # the contributors the reduction used
    offer: Offer | None = None  # the reduced slice, signed, for learning.reduced
    reduced: trio.Event = dc_field(default_factory=trio.Event)
    result_at: float = 0.0  # when the last slice this member needed came (its own reduced, or one fetched)
    served: set = dc_field(default_factory=set)  # members the reduced slice went to
    served_all: trio.Event = dc_field(default_factory=trio.Event)  # ... every other member on the roster
    sent: trio.Event = dc_field(default_factory=trio.Event)  # set (and replaced) as each send of it ends
    left: set = dc_field(default_factory=set)  # members on the roster that said goodbye (not waited for)
    calls: dict = dc_field(default_factory=dict)  # peer -> cancel scopes of this member's calls to it

    @contextlib.contextmanager
    def call_to(self, peer: bytes):
        """A cancel scope for one call to ``peer``, cancelled when it leaves (at once if it has)."""
        with trio.CancelScope() as scope:
            if peer in self.left:
                scope.cancel()
            scopes = self.calls.setdefault(peer, [])
            scopes.append(scope)
            try:
                yield
            finally:
                scopes.remove(scope)


class Group:
    """This member's side of group ``name``."""

    def __init__(self, host: Host, config: LearningSection, name: str, *, algorithm: str, rule: str,
                 bulk: Bulk, states: StateStore | None = None):
        self._host = host
        self._bulk = bulk
        self.states = states  # the shards service (None when it is off): whole states move as shards models
        # -> (version, round, tensors, hash function) of the state offered now (set by DiLoCo)
        self.state_source: Callable[[], tuple] | None = None
        self.shared: Shared | None = None  # the state last published as a shards model
        self.published = 0  # states published as shards models (for members that joined)
        self._sharing = trio.Lock()
        self._config = config
        self.name, self.algorithm, self.rule = name, algorithm, rule
        self.me = self._host.peer_id.key
        self.tag = f"group {name} at {self._host.peer_id.short()}"  # what its log lines start with
        self.view = GroupView(self.me, heartbeat_interval=config.heartbeat_interval,
                              min_timeout=3 * config.heartbeat_interval)
        self.clock = RoundClock(floor=config.round_timeout_min, ceiling=config.round_timeout_max)
        self.limits = Limits(max_bytes=config.max_bytes)
        self.round = 0  # the round this member works on
        self.joined: int | None = None  # the first round it contributes to; None until it has the group's state
        self.hash: bytes | None = None  # blake3 of the shared state after round hash_round
        self.hash_round = -1
        self.hashes: dict[int, bytes] = {}  # round -> this member's hash after it, for the latest rounds
        self.bytes_in: Counter = Counter()  # peer key -> bytes received
        self.bytes_out: Counter = Counter()  # ... and sent: contributions and reduced slices
        self.state_bytes_out: Counter = Counter()  # ... and the states it served to members joining
        self.samples: Counter = Counter()  # peer key -> samples contributed, last round it did
        self.clipped: Counter = Counter()  # peer key -> rounds its contribution was clipped
        self.used: Counter = Counter()  # peer key -> rounds its contribution was in a reduction here
        self.suspects: set[bytes] = set()  # members clipped in most of the rounds they sent here (reported)
        self.cancel_scope = trio.CancelScope()
        self.wake = trio.Event()  # greet now rather than at the next heartbeat
        self.settled = trio.Event()  # the first discovery and greeting are done
        self._heard = trio.Event()  # set (and renewed) by every hello taken in
        self._heard_of: set[bytes] = set()  # named by the DHT or a hello, not heard from yet
        self._left: dict[bytes, int] = {}  # member -> the first round it said it would not contribute to
        # kind -> offer, or what signs it when pulled, or (withheld) the event its next offer sets
        self._offers: dict[str, Offer | Callable[[], Offer] | trio.Event] = {}
        self.serving: Counter = Counter()  # kind -> pulls of that offer under way (its tensors must not change)
        self._exchanges: dict[tuple, Exchange] = {}  # (round, fragment) -> its all-reduce
        self._rosters: dict[int, list[bytes]] = {}  # round -> its contributors, once agreed
        self._roster_pending: dict[int, trio.Event] = {}  # rounds whose roster is being asked for
        self.announce: dict = {}  # more fields for this member's hellos (the membership document's owner)

    # --- membership ---------------------------------------------------------------------

    def hello(self) -> dict:
        """What this member tells others about itself."""
        now = trio.current_time()
        return {**self.announce, "group": self.name, "round": self.round, "joined": self.joined,
                "hash": self.hash, "hash_round": self.hash_round,
                "hashes": [[r, h] for r, h in sorted(self.hashes.items())],
                "members": [m for m in self.view.live(now) if m != self.me][:_HELLO_MEMBERS]}

    def heard_of(self, peer: bytes) -> None:
        """Note ``peer`` as a possible member, to be greeted (not one that said goodbye:
        others name it until they hear of it, and its DHT record outlives it)."""
        if peer != self.me and peer not in self.view.members and peer not in self._left:
            self._heard_of.add(peer)

    def hello_from(self, peer: PeerId, info: object) -> None:
        """Take in ``peer``'s hello (its request or its reply to ours)."""
        if not isinstance(info, dict):
            raise InvalidArgument("a hello is a map")
        if len(self.view.members) >= self._config.max_members and peer.key not in self.view.members:
            return
        if peer.key in self._left:  # a hello sent before its goodbye is stale; a new start (no state
            said = info.get("round")  # yet) or a later round is a member that came back
            if info.get("joined") is not None and not (type(said) is int and said > self._left[peer.key]):
                return
            del self._left[peer.key]
        try:
            self.view.heard(peer.key, info, trio.current_time())
        except ValueError as exc:
            raise InvalidArgument(f"bad hello: {exc}") from None
        self._heard_of.discard(peer.key)
        self._heard.set()
        self._heard = trio.Event()
        for exchange in list(self._exchanges.values()):  # it may have moved past a round that waits for it
            if exchange.core is not None and peer.key in exchange.roster and not exchange.served_all.is_set():
                self._check_served(exchange)
        others = info.get("members")
        if isinstance(others, list):
            for other in others[:_HELLO_MEMBERS]:
                if isinstance(other, bytes) and len(other) == 32:
                    self.heard_of(other)

    def seen(self, peer: bytes) -> None:
        """Note that member ``peer`` spoke (any request or signed answer): it is live now."""
        if peer in self.view.members:
            self.view.heard(peer, {}, trio.current_time())

    def to_greet(self) -> list[bytes]:
        """The members and possible members to say hello to this heartbeat: the
        quiet ones too (after a stall every member looks quiet to every other,
        and only greeting them brings the group back)."""
        return sorted({*self.view.members, *self._heard_of} - {self.me})

    async def greet(self, peer: PeerId) -> None:
        """Say hello to ``peer``; a live one that does not answer within the round
        clock's floor is not heard from, and a quiet one that does not answer
        within a heartbeat is forgotten if it has been quiet longer than a stall
        of this process explains (:meth:`_long_quiet`; the DHT or another
        member's hello brings it back if it returns).  The service runs each
        greeting on its own, so a slow one holds back no other."""
        live = peer.key in self.view.live(trio.current_time())
        try:
            with trio.fail_after(self.clock.floor if live else self.view.heartbeat_interval):
                reply = await self._host.rpc.call(peer, "learning.hello", self.hello())
            self.hello_from(peer, reply)
        except (RpcError, trio.TooSlowError, OSError) as exc:
            log.debug("%s: no hello from %s: %s", self.tag, peer.short(), exc)
            if isinstance(exc, NotFound) or self._long_quiet(peer.key):
                self._heard_of.discard(peer.key)
                self.view.drop(peer.key)

    async def farewell(self) -> None:
        """Tell every member this one knows that it leaves (``learning.bye``), all at
        once, each within a heartbeat: they stop counting it at once instead of after
        its silence, and an exchange of this round or later stops waiting for it.
        Those it greets are told too, quiet or not yet heard: one may hold this
        member's hello while its answer is still on the way."""
        arg = {"group": self.name, "round": self.round}

        async def bye(peer: bytes) -> None:
            with trio.move_on_after(self.view.heartbeat_interval):
                try:
                    await self._host.rpc.call(PeerId(peer), "learning.bye", arg)
                except (RpcError, OSError) as exc:
                    log.debug("%s: no goodbye to %s: %s", self.tag, PeerId(peer).short(), exc)

        async with trio.open_nursery() as nursery:
            for peer in self.to_greet():
                nursery.start_soon(bye, peer)

    def serve_bye(self, peer: PeerId, arg: object) -> None:
        """Take ``peer``'s goodbye: it is no longer a member, contributes nothing from
        ``arg``'s round on (an exchange of that round or later that names it stops
        waiting for its part, and the slice it reduces is missing), until it greets
        the group again from a later round or anew."""
        round_ = field(arg, "round", int)
        if round_ < 0:
            raise InvalidArgument("round is >= 0")
        self.view.drop(peer.key)
        self._heard_of.discard(peer.key)
        self._left.pop(peer.key, None)  # to the end: the oldest goodbyes are forgotten first
        self._left[peer.key] = round_
        while len(self._left) > self._config.max_members:
            del self._left[next(iter(self._left))]
        for exchange in self._exchanges.values():
            if exchange.core is not None and exchange.key[0] >= round_ and peer.key in exchange.core.members:
                self._lose(exchange, peer.key)
        self._heard.set()  # the view changed: what waits on it looks again
        self._heard = trio.Event()
        log.info("%s: %s left (from round %d on)", self.tag, peer.short(), round_)

    def _lose(self, exchange: Exchange, peer: bytes) -> None:
        """Stop waiting in ``exchange`` for ``peer``, which left: its part, its slice, its fetch."""
        exchange.left.add(peer)
        exchange.core.left(peer)
        self._publish_reduced(exchange)
        for scope in exchange.calls.get(peer, ()):
            scope.cancel()
        self._check_served(exchange)

    def live(self) -> list[bytes]:
        """The members heard from lately, this one included (sorted keys)."""
        return sorted({*self.view.live(trio.current_time()), self.me})

    def source(self) -> tuple[bytes, bool]:
        """The live member to take the group's state from (:func:`learn.group.state_source`:
        the furthest ahead whose state another member holds too, a silent one included,
        else the furthest ahead), and whether its state is so corroborated."""
        live = set(self.view.live(trio.current_time()))
        states = {k: (m.round, m.hashes) for k, m in self.view.members.items() if k in live}
        states[self.me] = (self.round, self.hashes)
        silent = [m.hashes for k, m in self.view.members.items() if k not in live]
        source, holders = state_source(states, silent)
        return source, holders >= 2

    def holds(self, peer: bytes) -> bool:
        """Whether this member's hashes hold ``peer``'s latest state (the same hash for its round)."""
        hashes = self.view.members[peer].hashes
        return bool(hashes) and self.hashes.get(max(hashes)) == hashes[max(hashes)]

    async def ahead_of(self, round: int) -> bytes:
        """The key of the source of the group's state (:meth:`source`) once it works two
        rounds or more past ``round``: ``round``'s exchange is over there, and what it kept
        of it goes soon."""
        while True:
            source, _ = self.source()
            if source != self.me and self.view.members[source].round > round + 1:
                return source
            await self._heard.wait()

    async def next_hello(self) -> None:
        """Return once the next hello is taken in (or the view changes otherwise)."""
        await self._heard.wait()

    def rewind(self, round: int) -> None:
        """Forget this member's rosters, exchanges and hashes of ``round`` and after: it goes
        back to the group's state of ``round`` (it had trained ahead alone)."""
        self._rosters = {r: roster for r, roster in self._rosters.items() if r < round}
        self._exchanges = {key: exchange for key, exchange in self._exchanges.items() if key[0] < round}
        self.hashes = {r: hash_ for r, hash_ in self.hashes.items() if r < round - 1}

    def publish_hash(self, round: int, hash: bytes) -> None:
        """Say (in the hellos from now on, the next one at once) that this member's state
        after ``round`` has ``hash``: the others corroborate states by these hashes, and
        with rounds shorter than a heartbeat they held none of ours, so one member
        claiming to be far ahead was the only state left to take."""
        self.hash, self.hash_round = hash, round
        if round >= 0:  # -1: the state a run starts from, before any round
            self.hashes[round] = hash
            self.hashes = {r: self.hashes[r] for r in sorted(self.hashes)[-HASH_HISTORY:]}
        self.wake.set()

    async def dissent(self, wait: float) -> bytes | None:
        """A member holding the majority's state hash if ours differs from it, else None
        (:func:`learn.group.majority`: in a tie, the hash of the member furthest ahead).

        Waits (up to ``wait`` seconds) until every live member has said its hash
        for our round, then counts the hashes of that round, ours included; a
        member that has moved on still votes with the hash it had then."""
        def hashes() -> dict[bytes, tuple[bytes, int]]:
            live = self.live()
            found = {k: (m.hashes[self.hash_round], m.round) for k, m in self.view.members.items()
                     if k in live and self.hash_round in m.hashes}
            if self.hash is not None:
                found[self.me] = (self.hash, self.round)
            return found

        with trio.move_on_after(wait):
            while len(hashes()) < len(self.live()):
                await self._heard.wait()
        top = majority(hashes())
        return None if top is None or top[0] == self.hash else top[1]

    def contributors(self, round: int) -> list[bytes]:
        """The members expected to contribute to ``round`` (sorted keys): the live trainers
        that joined by then or were on the round before's roster, and those that have not
        said when they join (they have no state of the group's yet) if they work on ``round``
        itself.  Those say round 0: at a run's start they are in round 0; one that comes (or
        comes back) later is left off the round in progress, which it could not contribute
        to before it has taken the state.  The roster before counts because a round can end
        before the hello that says a member joined comes (a member that took the state at
        a run's start says so in its next hello)."""
        now = trio.current_time()
        members, before = self.view.members, set(self._rosters.get(round - 1, ()))
        unsaid = [p for p in self.view.live(now) if members[p].joined is None and members[p].role == "trainer"
                  and (members[p].round == round or p in before)]
        return sorted({*self.view.eligible(round, now), *unsaid, self.me})

    # --- offering and pulling tensor sets ------------------------------------------------

    def _sign(self, round: int, kind: str, named: list, samples: int, digest: bytes | None = None) -> Offer:
        """``named`` as a contribution of ``kind`` signed by this member (``digest``: its
        :func:`learn.wire.digest_of`, if taken already)."""
        contribution = Contribution(group=self.name, round=round, author=self.me, kind=kind,
                                    samples=samples, digest=digest or digest_of(named, _hash_threads()))
        return Offer(contribution, contribution.sign(self._host.identity.sign), named)

    def offer(self, kind: str, round: int, named: list, samples: int = 0) -> None:
        """Offer ``named`` ((name, Encoded) pairs, unchanged while offered) to
        ``learning.pull`` of ``kind``; it is digested and signed when first pulled."""
        withheld = self._offers.get(kind)
        self._offers[kind] = functools.partial(self._sign, round, kind, named, samples)
        if isinstance(withheld, trio.Event):
            withheld.set()

    def withhold(self, kind: str) -> None:
        """Until the next :meth:`offer` of ``kind``, pulls of it (and, for the state,
        ``learning.state``) wait: its tensors are being written.  Pulls under way
        go on reading (:attr:`serving` counts them)."""
        if not isinstance(self._offers.get(kind), trio.Event):
            self._offers[kind] = trio.Event()

    async def _offered(self, kind: str):
        """The offer of ``kind`` (None if there is none), once it is not withheld."""
        offer = self._offers.get(kind)
        while isinstance(offer, trio.Event):
            await offer.wait()
            offer = self._offers.get(kind)
        return offer

    async def serve_pull(self, peer: PeerId, kind: str, *, lane: bool) -> AsyncIterator[dict]:
        offer = await self._offered(kind)
        if offer is None:
            raise Unavailable(f"no {kind} offered in group {self.name!r} yet")
        if not isinstance(offer, Offer):
            offer = self._offers[kind] = offer()
        self.serving[kind] += 1
        try:
            async for item in self._send(peer, offer, lane=lane):
                yield item
        finally:
            self.serving[kind] -= 1
        if kind == "state":
            self._taking_state(peer.key, offer.contribution.round)

    def _taking_state(self, peer: bytes, round: int) -> None:
        """Note that ``peer``, heard from but not yet joined, takes our state of ``round``
        and so contributes from that round on (what its next hello will say): a roster
        fixed here before that hello comes has it on, rather than only from the round after."""
        member = self.view.members.get(peer)
        if member is not None and member.joined is None:
            self.view.heard(peer, {"round": round, "joined": round}, trio.current_time())

    async def pull(self, peer: PeerId, kind: str, *, timeout: float) -> tuple[Contribution, list]:
        """``peer``'s offer of ``kind``: its signed contribution and (name, Encoded) pairs.

        Raises RpcError (or trio.TooSlowError past ``timeout``) if the peer
        does not deliver, InvalidArgument if what it sends is malformed or
        its signature does not check."""
        with trio.fail_after(timeout):
            return await _lane_or_quic(lambda lane: self._pull(peer, kind, lane), self._bulk.enabled)

    async def _pull(self, peer: PeerId, kind: str, lane: bool) -> tuple[Contribution, list]:
        async with self._host.rpc.stream(peer, "learning.pull",
                                         {"group": self.name, "kind": kind, "lane": lane}) as items:
            return await self._receive(peer, items, kind=kind)

    # --- whole states over shard sync -------------------------------------------------------

    def _state_model_name(self) -> str:
        return scoped_name("learning/", self.name, "/state", 200)

    async def serve_state(self, peer: PeerId) -> dict:
        """``learning.state``: this member's whole state (θ and the outer momentum) as a
        shards model, published now, or the one published before if the state has not
        changed since (the members that join in one round share one publish); its model
        id, round and hash.  Publishing unpins the state published before."""
        if self.states is None:
            raise Unavailable("the shards service is off on this member")
        if self.state_source is None:
            raise Unavailable(f"no state offered in group {self.name!r} yet")
        self.seen(peer.key)
        async with self._sharing:
            await self._offered("state")
            version, round_, tensors, hash_of = self.state_source()
            shared = self.shared
            if shared is None or shared.version != version:
                self.serving["state"] += 1  # the outer step steps copies while these are read
                try:
                    digest = await trio.to_thread.run_sync(hash_of)
                    model = await self.states.publish_tensors(self._state_model_name(), tensors, version=round_)
                finally:
                    self.serving["state"] -= 1
                shared = self.shared = Shared(version, round_, digest, model)
                self.published += 1
        self._taking_state(peer.key, shared.round)
        return {"model": shared.model, "round": shared.round, "hash": shared.hash}

    async def take_state(self, best: PeerId, *, timeout: float) -> tuple[int, bytes, dict]:
        """``best``'s state over shard sync: (round, hash, tensors by name).

        ``best`` and up to :data:`STATE_PROVIDERS` − 1 other live members whose last
        hash is ``best``'s are asked to publish their state (``learning.state``); the
        tensors come from ``best`` and every other that says the same round and hash
        at once (the same bits make the same chunks), into memory.  The hash is the one
        ``best`` says: the caller checks the tensors against it.  Raises RpcError,
        trio.TooSlowError past ``timeout`` or whatever the shards fetch raises."""
        members = self.view.members
        theirs = members.get(best.key)
        others: list[bytes] = []
        if theirs is not None and theirs.hash is not None:
            live = self.view.live(trio.current_time())
            others = sorted(k for k in live if k not in (self.me, best.key) and members[k].hash == theirs.hash
                            and members[k].hash_round == theirs.hash_round)[:STATE_PROVIDERS - 1]
        arg = {"group": self.name}
        replies: dict[bytes, dict] = {}

        async def ask(peer: bytes) -> None:
            try:
                replies[peer] = _check_state(await self._host.rpc.call(PeerId(peer), "learning.state", arg,
                                                                       timeout=timeout))
            except (RpcError, OSError) as exc:
                log.info("%s: %s publishes no state: %s", self.tag, PeerId(peer).short(), exc)

        with trio.fail_after(timeout):
            async with trio.open_nursery() as nursery:
                for peer in others:
                    nursery.start_soon(ask, peer)
                started = trio.current_time()
                first = _check_state(await self._host.rpc.call(best, "learning.state", arg, timeout=timeout))
                took = trio.current_time() - started  # the others, asked at the same moment, get as long again
                nursery.cancel_scope.deadline = trio.current_time() + max(took, self.view.heartbeat_interval)
            same = [k for k, r in sorted(replies.items()) if (r["round"], r["hash"]) == (first["round"], first["hash"])]
            tensors = await self.states.fetch_tensors(first["model"], [best, *map(PeerId, same)])
        return first["round"], first["hash"], tensors

    # --- the round's roster ----------------------------------------------------------------

    async def roster(self, round: int) -> list[bytes]:
        """The contributors of ``round`` (sorted keys), the same list on every member that asks.

        A member takes the roster from the lowest-key live member that answers
        ``learning.roster``, which takes it the same way from members below it,
        so the roster is fixed once, by the lowest member reachable, and handed
        on unchanged; a member with nobody below it that answers takes one a
        member above already holds, or else fixes it from its own view (the
        live trainers that joined by ``round``).  Once had, a
        roster never changes, so members that time each other out at different
        moments still agree on who reduces which slice.  Members not on the
        roster sit the round out and take its outcome like everyone else."""
        while round not in self._rosters:
            pending = self._roster_pending.get(round)
            if pending is not None:
                await pending.wait()
                continue
            pending = self._roster_pending[round] = trio.Event()
            try:
                roster = await self._ask_roster(round)
                if roster is None:
                    await self._hear_out(self._lately_quiet)  # before a roster is fixed from this view
                    roster = self.contributors(round)
                    self._log_fixed(round, roster)
                self._rosters[round] = roster
                while len(self._rosters) > KEEP_ROUNDS:
                    del self._rosters[min(self._rosters)]
            finally:
                del self._roster_pending[round]
                pending.set()
        return self._rosters[round]

    def _log_fixed(self, round: int, roster: list[bytes]) -> None:
        """Log a roster this member fixed: at INFO, with what its view held of each member,
        where it differs from the round before's (a member joins, dies, or, where the
        view was wrong, a round splits: what that starts from is then in the log)."""
        before = self._rosters.get(round - 1)
        if before is None or before == roster:
            log.debug("%s: fixed round %d's roster: %d members", self.tag, round, len(roster))
            return
        now = trio.current_time()
        seen = ", ".join(f"{PeerId(k).short()} round {m.round} heard {now - m.last_seen:.2f} s ago"
                         for k, m in sorted(self.view.members.items()))
        log.info("%s: fixed round %d's roster: %d members, %+d on round %d's (view: %s)", self.tag, round,
                 len(roster), len(roster) - len(before), round - 1, seen or "nobody")

    def _lately_quiet(self) -> list[bytes]:
        """The members silent for one to :data:`STALL_REACH` dead-after spans: quiet,
        but for no longer than a stall of this process (its hellos unread) may explain."""
        now, dead_after = trio.current_time(), self.view.dead_after()
        return [p for p, m in self.view.members.items()
                if dead_after <= now - m.last_seen < STALL_REACH * dead_after]

    def _long_quiet(self, peer: bytes) -> bool:
        """Whether ``peer`` was never heard, or not for :data:`STALL_REACH` dead-after spans
        (past :meth:`_lately_quiet`): forgetting it then cannot take a stall for a death."""
        member = self.view.members.get(peer)
        return member is None or trio.current_time() - member.last_seen >= STALL_REACH * self.view.dead_after()

    async def _hear_out(self, quiet: Callable[[], object]) -> None:
        """Wait up to two heartbeats while ``quiet()`` holds.

        A stall of this process (a long reduce, a busy machine) leaves the others'
        hellos unread meanwhile, so on waking they look quiet; taking that for their
        silence fixed rosters of this member alone, or forgot them.  Two heartbeats,
        not one: a member stalled too (on the same busy machine) first has to wake
        and send its next hello.  A member really gone costs this wait once."""
        with trio.move_on_after(2 * self.view.heartbeat_interval):
            while quiet():
                await self._heard.wait()

    async def _ask_roster(self, round: int) -> list[bytes] | None:
        """The roster of the lowest member below this one that has or fixes one;
        failing that, one a member above already holds (this member joined or
        came back after it was fixed); None if nobody has one.

        A member that is live but slow to answer is asked again until it
        answers or goes quiet (one busy member does not split the round); one
        gone quiet (and not heard within two heartbeats after, see
        :meth:`_heard_again`) is forgotten until heard again, so a dead member
        costs its silence, once.  Members below gone quiet are asked too: a busy member
        can be late with its hellos and still be the one that fixed the roster."""
        deadline = trio.current_time() + self.clock.timeout()
        for peer in sorted(k for k in self.view.members if k < self.me):
            roster = await self._roster_from(peer, round, deadline)
            if roster is not None:
                return roster
        found: list = []

        async def held(peer: bytes) -> None:
            roster = await self._roster_from(peer, round, deadline, held=True)
            if roster is not None:
                found.append(roster)
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            for peer in self.view.live(trio.current_time()):
                if peer > self.me:
                    nursery.start_soon(held, peer)
        return found[0] if found else None

    async def _roster_from(self, peer: bytes, round: int, deadline: float, *,
                           held: bool = False) -> list[bytes] | None:
        """``peer``'s roster of ``round`` (with ``held``, only one it has already: a
        quick look, asked again after each heartbeat without an answer); None once
        it says it gives none, goes quiet, or ``deadline`` passes."""
        arg = {"group": self.name, "round": round, **({"held": True} if held else {})}
        while True:
            try:
                with trio.fail_after(self.view.heartbeat_interval if held else self.clock.floor):
                    return self._check_roster(await self._while_heard(
                        peer, self._host.rpc.call, PeerId(peer), "learning.roster", arg))
            except (NotFound, InvalidArgument, PermissionDenied) as exc:  # it will not give one: next
                log.debug("%s: %s gives no roster of round %d: %s", self.tag, PeerId(peer).short(), round, exc)
                return None
            except (RpcError, trio.TooSlowError, OSError) as exc:
                log.info("%s: no roster of round %d from %s yet: %r", self.tag, round, PeerId(peer).short(), exc)
            if not await self._heard_again(peer):
                log.info("%s: %s went quiet; round %d's roster is asked of the next member",
                         self.tag, PeerId(peer).short(), round)
                self.view.drop(peer)
                return None
            if trio.current_time() >= deadline:
                return None
            with trio.move_on_after(self.view.heartbeat_interval):  # give it a moment, or hear it go quiet
                await self._heard.wait()

    async def _heard_again(self, peer: bytes) -> bool:
        """Whether ``peer`` is live, or heard again within two heartbeats if it looks quiet
        (:meth:`_hear_out`: a stall of this process during an ask leaves its hellos unread)."""
        def quiet() -> bool:
            return peer not in self.view.live(trio.current_time())

        await self._hear_out(quiet)
        return not quiet()

    async def _while_heard(self, peer: bytes, fn: Callable, *args):
        """``await fn(*args)``, or trio.TooSlowError once ``peer`` goes quiet first: a
        member that died without a goodbye costs its silence, not the call's timeout.
        Never before two heartbeats: after a stall of this process every member looks
        quiet until its next hello is read."""
        done: list = []  # [(result, None)] or [(None, the exception)]
        grace = trio.current_time() + 2 * self.view.heartbeat_interval

        async def answer() -> None:
            try:
                done.append((await fn(*args), None))
            except Exception as exc:  # noqa: BLE001  (raised below, outside the nursery)
                done.append((None, exc))
            nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer)
            while (member := self.view.members.get(peer)) is not None \
                    and trio.current_time() < (quiet_at := max(grace, member.last_seen + self.view.dead_after())):
                await trio.sleep_until(quiet_at)
            nursery.cancel_scope.cancel()
        if not done:
            raise trio.TooSlowError(f"{PeerId(peer).short()} went quiet")
        result, exc = done[0]
        if exc is not None:
            raise exc
        return result

    async def serve_roster(self, peer: PeerId, arg: object) -> dict:
        """Answer ``learning.roster``: the roster of ``arg``'s round (fixing or
        asking for it), or with ``held`` only one this member already has;
        NotFound for none held, or for a round too far from this member's
        (more than one round ahead of it, or past its kept rosters)."""
        round_ = field(arg, "round", int)
        self.seen(peer.key)
        if arg.get("held"):
            if round_ not in self._rosters:
                raise NotFound(f"no roster of round {round_} here")
            return {"members": self._rosters[round_]}
        if not self.round - KEEP_ROUNDS < round_ <= self.round + 1:  # no roster fixed further ahead from a view
            # that is still to change (who has joined by then); the asker goes to the next member
            raise NotFound(f"round {round_} is too far from this member's round {self.round}")
        return {"members": await self.roster(round_)}

    def _check_roster(self, reply: object) -> list[bytes]:
        members = field(reply, "members", list)
        if not 0 < len(members) <= self._config.max_members or members != sorted(set(members)) \
                or not all(isinstance(m, bytes) and len(m) == 32 for m in members):
            raise InvalidArgument("a roster is a sorted list of distinct 32-byte keys")
        return members

    # --- the all-reduce ----------------------------------------------------------------------

    async def allreduce(self, key: tuple, flat, *, samples: int, encode: Callable, decode: Callable,
                        reduce: Callable, out=None, error=None,
                        stream: bool = False) -> tuple[object, list[tuple[int, int]], set[bytes]]:
        """Average ``flat`` (a float32 vector) with the other contributors of round ``key[0]``.

        The round's :meth:`roster` cuts the vector into one slice per
        contributor and names each slice's reducer; :class:`learn.allreduce.AllReduce`
        keeps the round and this shell moves its slices: parts to their
        reducers (``learning.part``), reduced slices back (``learning.reduced``).
        ``encode``/``decode`` apply the codec (a reducer keeps the decoding of
        what it sends, so every member holds the same bits); ``reduce(tensors,
        weights)`` returns the reduced slice and the indices of the
        contributions it clipped; ``key`` is (round, fragment).  Returns the
        averaged vector, the (start, end) ranges that could not be had (zeros
        there), and the contributors some reducer used.  A member not on the
        roster sends nothing and takes the reduced slices like the others.

        Where a lossy codec encodes a slice, ``flat`` is overwritten there by
        what the others receive (the decoding), and what the codec lost goes
        into ``error`` (a vector of ``flat``'s size, if given: the caller's
        error feedback; zeros for a member that sent nothing).  The average is
        written into ``out`` if given, and reduced slices sent uncompressed are
        received straight into it; ``out`` may be ``flat`` itself, each slice
        then overwritten once this member's part of it has gone to its
        reducer: a large model's exchange then maps no new memory for
        either.

        With ``stream`` (``reduce`` must then be the sample-weighted mean) this
        member's slice is reduced as the parts come, into ``out``
        (:class:`learn.allreduce.StreamingAllReduce`): it holds none of the
        parts it is sent.  Its reduced slice is then served from ``out``
        until every member on the roster has it; a copy is kept for later
        fetchers only where one may still come, so ``out`` is the caller's
        again when this returns."""
        import torch  # noqa: PLC0415  (torch, and learn's modules that use it, only where tensors are)
        from learn.allreduce import AllReduce, StreamingAllReduce, partition  # noqa: PLC0415

        started = trio.current_time()
        for older in self._exchanges.values():  # keep the reduced slices of the round before only (a member a
            if older.key[0] < key[0] - 1 and older.over:  # round behind may still fetch them): older ones are past
                older.offer = None  # their deadlines, and a large model's would stay in memory through this one
        members = await self.roster(key[0])
        exchange = self._exchange(key)
        exchange.roster = members
        ranges = partition(flat.numel(), members)
        contributing = self.me in members
        encoded = [self._encode_part(flat[lo:hi], encode, decode, None if error is None else error[lo:hi])
                   for lo, hi in ranges] if contributing else []
        if error is not None and not contributing:
            error.zero_()
        out = torch.empty_like(flat) if out is None else out
        gone = [trio.Event() for _ in members]  # this member's part i is with its reducer (or failed to go)
        for index in range(len(members)):
            if not contributing or members[index] == self.me or out.data_ptr() != flat.data_ptr():
                gone[index].set()

        def encode_reduced(value):  # for codec none, value itself; a lossy one's decoding is written into value
            encoded = encode(value)
            if encoded.codec != "none":
                decode(encoded, into=value)
            return encoded

        def reduce_part(tensors, weights):
            value, exchange.clipped = reduce(tensors, weights)
            return value

        timeout = self.clock.timeout()
        exchange.encode_reduced, exchange.streaming = encode_reduced, stream and contributing
        if exchange.streaming:
            core = exchange.core = StreamingAllReduce(self.me, members, flat, into=out, weight=max(1, samples),
                                                      now=trio.current_time(), timeout=timeout)
        else:
            core = exchange.core = AllReduce(self.me, members, flat, reduce=reduce_part, weight=max(1, samples),
                                             now=trio.current_time(), timeout=timeout)
        exchange.samples[self.me] = samples
        exchange.started.set()
        digest = roster_digest(members)
        for peer, (their_roster, index, tensor, their_samples) in exchange.early.items():
            if their_roster == digest:  # else sent under another roster: left out
                with contextlib.suppress(InvalidArgument):
                    self._take_part(exchange, peer, index, tensor, their_samples)
        exchange.early.clear()
        for peer, since in self._left.items():  # goodbyes heard before this member reached the round
            if since <= key[0] and peer in core.members and peer != self.me:
                self._lose(exchange, peer)
        self._publish_reduced(exchange)
        async with trio.open_nursery() as nursery:
            if contributing:
                nursery.start_soon(self._reduce_when_due, exchange)
                if len(members) > 1:  # stay until the others have this slice (it may be its last round)
                    self._check_served(exchange)
                    nursery.start_soon(_wait_until, exchange.served_all, core.deadline)
            for peer, index, _ in core.outgoing():
                nursery.start_soon(self._send_part, exchange, index, encoded[index], samples, timeout, gone[index])
            for index, (peer, (lo, hi)) in enumerate(zip(members, ranges)):
                if peer != self.me:
                    nursery.start_soon(self._fetch_reduced, exchange, index, decode, out[lo:hi], gone[index])
        core.expire(max(trio.current_time(), core.deadline))  # nothing more is on its way
        used_by_any = set()
        for index, (lo, hi) in enumerate(ranges):
            got = core.reduced(index)
            if got is None:
                out[lo:hi] = 0
            else:
                if got[0].data_ptr() != out[lo:hi].data_ptr():  # not received in place
                    out[lo:hi] = got[0]
                used_by_any.update(got[1])
        if exchange.streaming and exchange.offer is not None:
            await self._release_reduced(exchange, core.reduced(core.index)[0], core.deadline)
        exchange.over, exchange.core = True, None  # keep the offer, not the vectors
        missing = core.missing_parts()
        # How long the round took this member: until its last slice came, not until the others had
        # fetched its own (a member that left the round never does: that wait runs to the deadline,
        # and counting it made each such round's timeout the next one's measure, 3x: 30 -> 90 -> 270 s)
        self.clock.observe(max(exchange.result_at, started) - started,
                           complete=not missing and used_by_any >= set(members))
        return out, [ranges[i] for i in missing], used_by_any

    async def _release_reduced(self, exchange: Exchange, value, deadline: float) -> None:
        """Give the caller's vector back from a streamed reduction, whose slice ``value``
        is served from it: from now on the slice is served from a copy if a member
        may still ask (one on the roster does not have it, or one off the roster is
        live or only lately quiet: a stall of this process leaves hellos unread,
        and a member off the roster that looked gone then found no slice), else
        not at all; then wait for the sends of the slice under way to end, so
        none reads the vector once the caller writes it: until a round's
        timeout past ``deadline`` at most (a send waits that long for its
        fetcher), as a member that began its round later than this one fetches
        past this one's deadline."""
        offer = exchange.offer
        if exchange.served_all.is_set() and {*self.live(), *self._lately_quiet()} <= set(exchange.roster):
            exchange.offer = None
        else:
            from learn.compress import encode  # noqa: PLC0415

            (name, encoded), = offer.named
            kept = encode(value.clone()) if encoded.codec == "none" else encoded  # a lossy one has its own bytes
            exchange.offer = Offer(offer.contribution, offer.signature, [(name, kept)])
        with trio.move_on_at(deadline + self.clock.timeout()):
            while offer.readers:
                await exchange.sent.wait()
        if offer.readers:
            log.info("%s: round %d's slice given back with %d sends of it under way", self.tag,
                     exchange.key[0], offer.readers)

    @staticmethod
    def _encode_part(part, encode: Callable, decode: Callable, error):
        """``part`` encoded; where the codec loses, ``part`` becomes what the others
        receive of it and ``error`` (if given) what was lost."""
        encoded = encode(part)  # its own bytes: part may change now
        if encoded.codec != "none":
            if error is not None:
                decode(encoded, into=error)
                error.sub_(part).neg_()  # part − received, exactly: no buffer of the part's size
            decode(encoded, into=part)
        elif error is not None:
            error.zero_()
        return encoded

    def _asked_exchange(self, key: tuple) -> Exchange:
        """The exchange ``key`` a peer's part or slice request names (see
        :meth:`_current_key`), made if new; Unavailable at once if this member went past
        that round without taking part in it (it finished its run, or took a later
        state): it never will, and a peer still in that round must not wait out the
        round's timeout for it."""
        exchange = self._exchanges.get(key)
        if key[0] < self.round and (exchange is None or (exchange.core is None and not exchange.over)):
            raise Unavailable(f"round {key[0]} {OVER}")
        return self._exchange(key)

    def _exchange(self, key: tuple) -> Exchange:
        exchange = self._exchanges.get(key)
        if exchange is None:
            exchange = self._exchanges[key] = Exchange(key)
            while len(self._exchanges) > KEEP_ROUNDS:
                del self._exchanges[min(self._exchanges)]
        return exchange

    def _take_part(self, exchange: Exchange, peer: bytes, index: int, tensor, samples: int) -> None:
        try:
            exchange.core.received_part(peer, index, tensor, max(1, samples))
        except ValueError as exc:  # learn.allreduce.AllReduceError: a bad or unexpected part
            raise InvalidArgument(str(exc)) from None
        exchange.samples[peer] = samples
        self._publish_reduced(exchange)

    async def _reduce_when_due(self, exchange: Exchange) -> None:
        """At the parts deadline, reduce this member's slice over the parts that came; a
        streamed one, by its ``reduce_by`` with the parts settled on, or lose it."""
        core = exchange.core
        for due in (core.parts_deadline, core.reduce_by) if exchange.streaming else (core.parts_deadline,):
            with trio.move_on_at(due):
                await exchange.reduced.wait()
            core.expire(max(trio.current_time(), due))
            self._publish_reduced(exchange)

    def _publish_reduced(self, exchange: Exchange) -> None:
        """Wake streamed parts once the weights are settled; once this member's slice
        is reduced: count who was clipped, sign the slice, serve it."""
        core = exchange.core
        if exchange.streaming and core.settled:
            exchange.settled.set()
        done = core.reduced(core.index) if core.index is not None else None
        if done is None or exchange.reduced.is_set():
            return
        encoded = exchange.encode_reduced(done[0])  # (this member then holds what the others receive)
        used = done[1]
        for index in exchange.clipped:
            self.clipped[used[index]] += 1
        for member in used:
            self.samples[member] = exchange.samples[member]
            self.used[member] += 1
            self._suspect(member)
        round_, fragment = exchange.key
        exchange.offer = self._sign(round_, f"reduced:{fragment}:{core.index}", [("slice", encoded)], 0)
        exchange.used = used
        exchange.result_at = max(exchange.result_at, trio.current_time())
        exchange.reduced.set()

    def _suspect(self, member: bytes) -> None:
        """Report (once, in the log and in ``meshctl learning status``) a member
        whose contributions this member's rule clipped in at least
        as many rounds as :func:`learn.membership.suspect` asks, and in most of the rounds it took part in."""
        clipped = self.clipped[member]
        if member not in self.suspects and suspect(clipped, self.used[member]):
            self.suspects.add(member)
            log.warning("%s: %s's contributions were clipped in %d of %d rounds: a bad or broken member?",
                        self.tag, PeerId(member).short(), clipped, self.used[member])

    async def _send_part(self, exchange: Exchange, index: int, encoded, samples: int, timeout: float,
                         gone: trio.Event) -> None:
        """Send this member's part ``index`` to its reducer (``gone`` is set when that is over, either way)."""
        members = exchange.core.members
        reducer = PeerId(members[index])
        named = [("slice", encoded)]
        digest = await trio.to_thread.run_sync(digest_of, named, _hash_threads())  # (blake3 lets go of the GIL)
        offer = self._sign(exchange.key[0], f"part:{exchange.key[1]}:{index}", named, samples, digest)
        head = {"group": self.name, "key": list(exchange.key), "index": index, "roster": roster_digest(members)}

        async def send(lane: bool) -> None:
            if not (lane and self._bulk.usable(reducer, named)):
                await self._host.rpc.client_stream(reducer, "learning.part", self._items(reducer, offer, head),
                                                   timeout=None)
                return
            with self._bulk.lend(offer.named) as loan:  # the reducer fetches them before it answers
                await self._host.rpc.client_stream(reducer, "learning.part",
                                                   [head, *self._lent_frames(offer, loan)], timeout=None)
                self._count_loan(self.bytes_out, reducer, loan)

        try:
            with exchange.call_to(reducer.key), trio.fail_after(timeout):
                await self._in_round(reducer.key, exchange.key[0], send)
        except (RpcError, trio.TooSlowError, OSError) as exc:
            log.info("%s: round %d's slice %d to %s failed: %r", self.tag, exchange.key[0], index,
                     reducer.short(), exc)
        finally:
            gone.set()

    async def _in_round(self, peer: bytes, round: int, call: Callable[[bool], object]):
        """``call`` to ``peer`` about ``round`` (:func:`_lane_or_quic`), asked again
        while ``peer`` refuses it for not being in that round yet (:meth:`_caught_up`)."""
        while True:
            try:
                return await _lane_or_quic(call, self._bulk.enabled)
            except Unavailable as exc:
                if not await self._caught_up(peer, round, exc):
                    raise

    async def _caught_up(self, peer: bytes, round: int, refused: Unavailable) -> bool:
        """After ``peer`` refused a call of ``round``: if it said that round is not current
        there and it has not passed it (it is behind: a member that runs ahead must not
        take the round for its own alone, and run further ahead), wait for a hello that
        says it works on the round before or later and return True (ask again); else
        False.  The caller bounds the wait."""
        member = self.view.members.get(peer)
        if member is None or not refused.message.startswith(f"round {round} {NOT_CURRENT}"):
            return False
        refused_at = member.last_seen
        while True:
            member = self.view.members.get(peer)
            if member is None or member.round > round + 1:
                return False
            if member.round >= round - 1 and member.last_seen > refused_at:
                return True
            await self._heard.wait()

    async def _fetch_reduced(self, exchange: Exchange, index: int, decode: Callable, place,
                             gone: trio.Event) -> None:
        """Take reduced slice ``index`` from its reducer (uncompressed, straight into
        ``place``, its part of the average, once ``gone`` says what ``place``
        held has gone), or leave it missing at the round's deadline."""
        from learn.tensors import tensor_view  # noqa: PLC0415

        core, (round_, fragment) = exchange.core, exchange.key
        reducer = PeerId(core.members[index])
        nbytes = place.numel() * place.element_size()

        def into(name: str, codec: str, size: int):
            return tensor_view(place, writable=True) if codec == "none" and size == nbytes else None

        try:
            with exchange.call_to(reducer.key), trio.fail_at(core.deadline):
                await gone.wait()

                async def take(lane: bool):
                    arg = {"group": self.name, "key": [round_, fragment], "index": index, "lane": lane}
                    async with self._host.rpc.stream(reducer, "learning.reduced", arg) as items:
                        return await self._receive(reducer, items, kind=f"reduced:{fragment}:{index}",
                                                   round=round_, with_used=True, into=into)

                _, named, used = await self._in_round(reducer.key, round_, take)
                core.received_reduced(reducer.key, index, _decode_into(decode, named[0][1], place),
                                      subset_of(core.members, used))
                exchange.result_at = max(exchange.result_at, trio.current_time())
        except (RpcError, trio.TooSlowError, OSError, ValueError) as exc:  # ValueError: CodecError, AllReduceError
            log.info("%s: no reduced slice %d of round %d from %s: %r", self.tag, index, round_,
                     reducer.short(), exc)

    def _current_key(self, arg: object) -> tuple[int, int]:
        """The exchange ``arg`` names, [round, fragment]: of the round before this
        member's, its round or the next (so a peer cannot make it keep others)."""
        key = tuple(field(arg, "key", list))
        if len(key) != 2 or not all(type(k) is int and k >= 0 for k in key):
            raise InvalidArgument("key is [round, fragment]")
        if not self.round - 1 <= key[0] <= self.round + 1:
            raise Unavailable(f"round {key[0]} {NOT_CURRENT} (round {self.round})")
        return key

    async def serve_part(self, peer: PeerId, head: object, items) -> dict:
        """Take ``peer``'s part of an all-reduce whose slice this member reduces.

        The head names the sender's roster by its digest: if this member has the
        round's roster already, a part under another roster, or of a slice it
        does not reduce, is refused before its tensors are read.  One that comes
        before this member reaches the round waits for it (half a round's timeout
        at most: its tensors then stream into the reduction), else is kept whole
        and checked when the round starts: the sender's call ends well within its
        own timeout, so a reducer far behind still gets the part."""
        key = self._current_key(head)
        roster = field(head, "roster", bytes)
        index = field(head, "index", int)
        exchange = self._asked_exchange(key)
        if exchange.core is None and not exchange.over:
            with trio.move_on_after(self.clock.timeout() / 2):
                await exchange.started.wait()
        members = exchange.core.members if exchange.core is not None else self._rosters.get(key[0])
        if members is not None:
            if roster != roster_digest(members):
                raise InvalidArgument(f"your roster of round {key[0]} differs from this member's")
            if peer.key not in members or members[index:index + 1] != [self.me]:
                raise PermissionDenied("this member does not reduce that slice for you")
        if exchange.streaming and not exchange.over:
            return await self._stream_part(exchange, peer, index, items)
        contribution, named = await self._receive(peer, items, kind=f"part:{key[1]}:{index}", round=key[0])
        from learn.compress import decode  # noqa: PLC0415  (torch only where tensors are)

        try:
            tensor = decode(named[0][1])
        except CodecError as exc:
            raise InvalidArgument(f"bad part: {exc}") from None
        if exchange.over:
            raise Unavailable(f"round {key[0]} {OVER}")
        if exchange.core is None:  # it came before this member reached the round: keep it for then
            if len(exchange.early) >= self._config.max_members:
                raise Unavailable("too many parts wait for this member to reach the round")
            exchange.early[peer.key] = (roster, index, tensor, contribution.samples)
            return {"early": True}
        if roster != roster_digest(exchange.core.members):  # the round started while its tensors came
            raise InvalidArgument(f"your roster of round {key[0]} differs from this member's")
        self._take_part(exchange, peer.key, index, tensor, contribution.samples)
        return {"ok": True}

    async def _stream_part(self, exchange: Exchange, peer: PeerId, index: int, items) -> dict:
        """Take ``peer``'s part into this member's streamed reduction: announced as its
        signed head comes, then (once the weights are settled) added chunk by chunk
        as it comes over QUIC or the lane, done once it is whole.  A part sent
        under a lossy codec is decoded whole and added then."""
        from learn.compress import decode  # noqa: PLC0415  (torch only where tensors are)

        core, (round_, fragment) = exchange.core, exchange.key
        announced = False

        def moved() -> None:
            if exchange.core is core:  # (not once the round is over here)
                self._publish_reduced(exchange)

        async def announce(contribution: Contribution) -> None:
            nonlocal announced
            if not core.announce(peer.key, index, max(1, contribution.samples)):
                raise Unavailable(f"round {round_}'s slice {index} is reduced here without your part")
            announced = True
            exchange.samples[peer.key] = contribution.samples
            moved()  # the last to come settles the weights
            with trio.move_on_at(core.deadline):
                await exchange.settled.wait()

        def into(name: str, codec: str, nbytes: int):
            return _Accumulate(core, peer.key) if codec == "none" else None

        try:
            _, named = await self._receive(peer, items, kind=f"part:{fragment}:{index}", round=round_,
                                           before=announce, into=into)
            if [name for name, _ in named] != ["slice"]:
                raise InvalidArgument("a part is one tensor, named slice")
            encoded = named[0][1]
            if encoded.dtype != "float32" or len(encoded.shape) != 1:  # (its values may be in the sum: lost)
                raise InvalidArgument("a part is a float32 vector")
            try:
                if not isinstance(encoded.payload, _Accumulate):
                    core.add(peer.key, 0, decode(encoded).reshape(-1))
                core.part_done(peer.key)
            except ValueError as exc:  # CodecError, AllReduceError
                raise InvalidArgument(f"bad part: {exc}") from None
        except BaseException:
            if announced:
                core.fail(peer.key)
            raise
        finally:
            moved()
        return {"ok": True}

    async def serve_reduced(self, peer: PeerId, arg: object) -> AsyncIterator[dict]:
        """Send this member's reduced slice of exchange ``key`` once it has one (waiting for it a while)."""
        exchange = self._asked_exchange(self._current_key(arg))  # perhaps before this member reached the round
        self.seen(peer.key)
        if not exchange.over:  # (once it is, the slice is here or never will be)
            with trio.move_on_after(2 * self.clock.timeout()):
                await exchange.reduced.wait()
        offer = exchange.offer
        if offer is None:
            raise Unavailable(f"exchange {list(exchange.key)} is not reduced here")
        offer.readers += 1
        try:
            async for item in self._send(peer, offer, lane=arg.get("lane") is True,
                                       used=subset_bits(exchange.roster, exchange.used)):
                yield item
        finally:
            offer.readers -= 1
            exchange.sent.set()
            exchange.sent = trio.Event()
        exchange.served.add(peer.key)
        self._check_served(exchange)

    def _check_served(self, exchange: Exchange) -> None:
        """Note when every other member on the roster has this member's reduced slice, left,
        or says it works on a later round: it is done with this one, or took a later state
        and never fetches (waiting for it ran this member's round to its deadline)."""
        members, round_ = self.view.members, exchange.key[0]
        past = {key for key in exchange.roster if (member := members.get(key)) is not None and member.round > round_}
        if exchange.served | exchange.left | past >= set(exchange.roster) - {self.me}:
            exchange.served_all.set()

    # --- moving signed tensor sets -----------------------------------------------------------

    async def _send(self, peer: PeerId, offer: Offer, *, lane: bool, **extra) -> AsyncIterator[dict]:
        """The frames of ``offer`` for ``peer``: the signed head, then the
        tensors; with ``lane`` (and a direct path) only their headers, the
        payloads lent on the bulk lane until ``peer`` has fetched them all
        (or a round's timeout passes).  The bytes count in
        :attr:`state_bytes_out` for a state, in :attr:`bytes_out` otherwise."""
        sent = self.state_bytes_out if offer.contribution.kind == "state" else self.bytes_out
        if lane and self._bulk.usable(peer, offer.named):
            with self._bulk.lend(offer.named) as loan:
                for frame in self._lent_frames(offer, loan, **extra):
                    yield frame
                with trio.move_on_after(self.clock.timeout()):
                    await loan.done.wait()
                self._count_loan(sent, peer, loan)
            return
        yield {"contribution": offer.contribution.to_wire(), "signature": offer.signature, **extra}
        for frame in frames(offer.named):
            sent[peer.key] += len(frame.get("c", b""))
            yield frame

    @staticmethod
    def _count_loan(sent: Counter, peer: PeerId, loan: Loan) -> None:
        if loan.done.is_set():
            sent[peer.key] += loan.nbytes

    @staticmethod
    def _lent_frames(offer: Offer, loan: Loan, **extra) -> list[dict]:
        """The signed head naming ``loan``'s ticket, then the tensors' headers (their payloads are lent)."""
        return [{"contribution": offer.contribution.to_wire(), "signature": offer.signature, **extra,
                 "lane": loan.ticket, "tensors": len(offer.named)},
                *(header(name, enc) for name, enc in offer.named)]

    async def _items(self, peer: PeerId, offer: Offer, head: dict) -> AsyncIterator[dict]:
        yield head
        async for item in self._send(peer, offer, lane=False):
            yield item

    async def _receive(self, peer: PeerId, items, *, kind: str, round: int | None = None,
                       with_used: bool = False, into: Into | None = None,
                       before: Callable[[Contribution], Awaitable[None]] | None = None):
        """Read a signed tensor set from ``items`` (payloads into the buffers
        ``into`` gives, as :class:`learn.wire.Decoder` takes it, else payloads
        over a chunk into fresh memory, mapped as it is written: one copy);
        InvalidArgument unless it is ``peer``'s, of ``kind`` (and ``round``) and
        whole.  ``before(contribution)`` is awaited once the signed head is
        checked, before any tensor is read.  The tensors are not checked against
        the head's signed digest: a set is taken only from its author, over
        QUIC (TLS 1.3) or the lane (AES-GCM keyed through that connection),
        which authenticate every byte as the author's; the digest is there for
        a copy passed on by someone else, which nothing here accepts."""
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
            if before is not None:
                await before(contribution)
            decoder = Decoder(self.limits, into=into or _fresh)
            named: list = []
            if "lane" in head:
                named = await self._receive_lent(peer, head, items, decoder)
            else:
                async for frame in items:
                    self.bytes_in[peer.key] += len(frame.get("c", b"")) if isinstance(frame, dict) else 0
                    named += decoder.feed(frame)
            decoder.finish()
            self.seen(peer.key)
        except (WireError, ValueError) as exc:
            raise InvalidArgument(f"bad tensor set from {peer.short()}: {exc}") from None
        if with_used:
            used = head.get("used")
            if not isinstance(used, bytes):
                raise InvalidArgument("a reduced slice names the contributors it used, as a bitmap over the roster")
            return contribution, named, used
        return contribution, named

    async def _receive_lent(self, peer: PeerId, head: dict, items, decoder: Decoder) -> list:
        """The tensors of a set whose payloads ``peer`` lends on the bulk lane:
        the headers from ``items``, each followed into ``decoder`` by its chunks
        from the lane.  Unavailable (NO_LANE) if the lane fails."""
        ticket, count = head["lane"], head.get("tensors")
        if not isinstance(ticket, bytes) or len(ticket) != 32 or type(count) is not int \
                or not 0 <= count <= self.limits.max_tensors:
            raise WireError("a lent tensor set names a 32-byte ticket and how many tensors it has")
        headers = [await anext(items, None) for _ in range(count)]
        counts = chunk_counts(headers, self.limits)
        named: list = []
        try:
            async with contextlib.aclosing(self._bulk.fetch(peer, ticket, sum(counts))) as chunks:
                for frame, n in zip(headers, counts):
                    named += decoder.feed(frame)
                    for _ in range(n):
                        data = await anext(chunks)
                        self.bytes_in[peer.key] += len(data)
                        named += decoder.feed({"c": data})
        except LaneError as exc:
            raise Unavailable(f"{NO_LANE}: {exc}") from None
        if await anext(items, None) is not None:
            raise WireError("frames after a lent tensor set's headers")
        return named


def _decode_into(decode: Callable, encoded, place):
    """A reduced slice sent through a lossy codec, decoded straight into ``place``
    (its part of the average) where it fits there, else into a tensor of its own
    (which the all-reduce then refuses if its size is wrong)."""
    if encoded.codec != "none":
        try:
            return decode(encoded, into=place)
        except CodecError:
            raise
        except ValueError:  # it does not fit there
            pass
    return decode(encoded)


class _Accumulate:
    """A streamed part's sink (:class:`learn.wire.Sink`): its float32 values go into
    the reduction as each chunk comes (:meth:`learn.allreduce.StreamingAllReduce.add`)."""

    def __init__(self, core, peer: bytes):
        from learn.tensors import float32_values  # noqa: PLC0415  (torch only where tensors are)

        self.core, self.peer, self._values = core, peer, float32_values

    def write(self, at: int, chunk: memoryview) -> None:
        if at % 4:
            raise ValueError("a streamed part's chunks hold whole float32 values")
        self.core.add(self.peer, at // 4, self._values(chunk))


def _hash_threads() -> int:
    from learn.tensors import hash_threads  # noqa: PLC0415  (torch only where tensors are)

    return hash_threads()


def _fresh(name: str, codec: str, nbytes: int) -> memoryview | None:
    """A payload's own buffer, for payloads of more than a chunk (torch.empty: pages are
    mapped as the chunks come, not when a peer announces a size)."""
    import torch  # noqa: PLC0415

    from learn.tensors import tensor_view  # noqa: PLC0415

    return tensor_view(torch.empty(nbytes, dtype=torch.uint8), writable=True) if nbytes > CHUNK else None


def scoped_name(prefix: str, group: str, suffix: str, limit: int) -> str:
    """``prefix + group + suffix`` for a name another service keeps for ``group``, with a
    digest of the group's name in its place where the whole would pass ``limit`` bytes."""
    name = prefix + group + suffix
    if len(name.encode()) <= limit:
        return name
    return prefix + hashlib.sha256(group.encode()).hexdigest()[:32] + suffix


def _check_state(reply: object) -> dict:
    """A ``learning.state`` reply: {model: 32-byte id, round: int, hash: 32 bytes}; InvalidArgument if not."""
    model, round_, digest = (field(reply, "model", bytes), field(reply, "round", int), field(reply, "hash", bytes))
    if len(model) != 32 or len(digest) != 32 or type(round_) is not int or round_ < 0:
        raise InvalidArgument("a state is {model: 32-byte id, round: int >= 0, hash: 32 bytes}")
    return {"model": model, "round": round_, "hash": digest}


async def _lane_or_quic(send: Callable[[bool], object], lane: bool):
    """``await send(lane)`` (True: payloads on the bulk lane where there is one);
    if the receiving side could not use the lane, ``await send(False)`` (over QUIC)."""
    if not lane:
        return await send(False)
    try:
        return await send(True)
    except Unavailable as exc:
        if NO_LANE not in exc.message:
            raise
        log.info("%s; sending over QUIC", exc.message)
    return await send(False)


async def _wait_until(event: trio.Event, deadline: float) -> None:
    with trio.move_on_at(deadline):
        await event.wait()


def _verify(public_key: bytes, signature: bytes, data: bytes) -> bool:
    return PeerId(public_key).verify(signature, data)
