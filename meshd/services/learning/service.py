"""Training groups, the service ``learning``: membership and tensor exchange.

A *group* is one training run, named by its users (``"run42"``).  Members
announce themselves as DHT providers of ``b"/learn/" + name`` and say hello
(``learning.hello``) to every member they know every
``learning.heartbeat_interval`` seconds; a hello carries the member's round,
its join round, its state hash and the other members it knows, so a group
finds itself quickly and a member that stops saying hello drops out.

A round's contributors are agreed over ``learning.roster``: fixed once by
the lowest member reachable and handed on unchanged (:meth:`Group.roster`).
Tensors move over three peer methods, each a set of named tensors in
:mod:`learn.wire` frames behind a signed :class:`learn.wire.Contribution`
(to a peer with a direct path the payloads go over the TCP bulk lane,
``learning.lane``, and only the headers over QUIC: :mod:`.bulk`):

* ``learning.pull`` (server stream): what a member offers now, its
  parameters (gossip) or its whole state (a joining or diverged member);
* ``learning.part`` (client stream): a contributor's slice of an all-reduce,
  sent to the slice's reducer;
* ``learning.reduced`` (server stream): the reducer's result for its slice,
  sent once it is ready.

With the ``shards`` service on (the root hands it in as a
:class:`~meshd.service.StateStore`), a joining or diverged member takes the
whole state over shard sync instead: ``learning.state`` asks a member to
publish its state as a shards model (once per state, shared by the members
that join in one round) and answers its id, round and hash; the member
fetches it from every member that published the same bits at once.

With the ``crdt`` service on, every member also keeps an entry (join time,
role, throughput, round) in the group's replicated membership document
(:mod:`.membership`); its hellos name the document's owner (``doc``).

The round logic lives in :mod:`learn`; the algorithms users call
(:class:`~meshd.services.learning.averager.GossipAverager`,
:class:`~meshd.services.learning.diloco.DiLoCo`) drive a :class:`Group`.
"""

from __future__ import annotations

import logging

import trio

from dht.network import DhtError

from ...identity import PeerId
from ...lane import LaneConfig
from ...rpc import InvalidArgument, NotFound
from ...rpc.args import field
from ...service import Documents, Host, Method, Providers, StateStore, check_name
from .bulk import METHOD as LANE_METHOD
from .bulk import Bulk
from .config import LearningSection
from .control import control_methods
from .group import Group
from .membership import Membership
from .shadows import clear as clear_shadows

log = logging.getLogger("meshd.learning")

PROVIDER_PREFIX = b"/learn/"


def check_group_name(name: object) -> str:
    """``name`` if it is a usable group name; ValueError otherwise."""
    return check_name(name, "a group name")


class Learning:
    """The training groups of a node (service ``learning``, config ``[learning]``)."""

    name = "learning"

    def __init__(self, host: Host, config: LearningSection, *, providers: Providers,
                 documents: Documents | None = None, states: StateStore | None = None,
                 lane: LaneConfig = LaneConfig()):
        self.host = host
        self.config = config
        self._providers = providers
        self._docs = documents  # None without the crdt service: groups then keep no membership document
        self._states = states  # None without the shards service: whole states then move over learning.pull
        self.groups: dict[str, Group] = {}
        self.memberships: dict[str, Membership] = {}  # group name -> this member's entry in its document
        self.sessions: dict[str, object] = {}  # group name -> the training script's session that drives it
        self.bulk = Bulk(host, enabled=config.lane, min_bytes=config.lane_min_bytes, limits=lane)
        self._nursery: trio.Nursery | None = None
        host.add_farewell(self._farewell)

    # --- the Service shape ---------------------------------------------------------

    def rpc_methods(self) -> dict:
        methods = {"learning.hello": self._serve_hello, "learning.roster": self._serve_roster,
                   "learning.pull": self._serve_pull, "learning.state": self._serve_state,
                   "learning.part": Method(self._serve_part, "client_stream"),
                   "learning.reduced": self._serve_reduced, "learning.bye": self._serve_bye}
        if self.bulk.server is not None:
            methods[LANE_METHOD] = self.bulk.server.issue
        return methods

    def control_methods(self) -> dict:
        return control_methods(self)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        left = clear_shadows(self.host.data_dir)  # the control socket is ours by now: no other daemon's files
        if left:
            log.info("removed %d shared shadows a previous daemon left", left)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.bulk.server is not None:
                await nursery.start(self.bulk.server.serve)
            task_status.started()
            await trio.sleep_forever()

    def status(self) -> dict:
        """Groups joined, and the bulk lane's TCP port ("off" by config, None until it listens)."""
        server = self.bulk.server
        return {"groups": len(self.groups), "lane": server.port if server is not None else "off"}

    def spawn(self, fn, *args) -> None:
        """Run ``fn(*args)`` in the service's background until the node stops."""
        self._nursery.start_soon(fn, *args)

    def close(self) -> None:
        self.sessions.clear()
        self.groups.clear()
        self.memberships.clear()

    # --- joining and leaving ---------------------------------------------------------

    def join(self, name: str, *, algorithm: str, rule: str) -> Group:
        """The group called ``name``, joined now if this node is not in it yet:
        announced in the DHT and greeted every heartbeat until :meth:`leave`."""
        check_group_name(name)
        group = self.groups.get(name)
        if group is None:
            if self._nursery is None:
                raise RuntimeError("the learning service is not running")
            group = self.groups[name] = Group(self.host, self.config, name, algorithm=algorithm, rule=rule,
                                              bulk=self.bulk, states=self._states)
            membership = self.memberships[name] = Membership(self.host, group, self._docs,
                                                             heartbeat=self.config.heartbeat_interval)
            self._nursery.start_soon(self._keep, group)
            self._nursery.start_soon(membership.run)
        return group

    def membership(self, name: str) -> Membership:
        """This member's entry in group ``name``'s membership document (KeyError if not in it):
        where the training loop reports its steps, samples and role."""
        return self.memberships[name]

    def leave(self, name: str) -> None:
        """Stop being a member of ``name``: its entry in the membership document says so
        at once, and the members it knows are told (``learning.bye``, in the background)."""
        group = self.groups.pop(name, None)
        if group is not None:
            self.memberships.pop(name).leave()
            group.cancel_scope.cancel()
            self._providers.unprovide(PROVIDER_PREFIX + name.encode())
            self._nursery.start_soon(group.farewell)

    async def _farewell(self) -> None:
        """As the node stops: say goodbye to every group's members at once."""
        async with trio.open_nursery() as nursery:
            for group in list(self.groups.values()):
                group.cancel_scope.cancel()
                nursery.start_soon(group.farewell)

    async def _keep(self, group: Group) -> None:
        """Announce ``group``, find its members, and greet them, until it is left.

        Greetings run on their own, one at a time per peer: a member that died
        but still looks live (its hello waits out the round clock's floor) holds
        back no hello to the others.  Only the first heartbeat's greetings are
        waited for, so that a member starting to train knows who is there, and
        that first lookup waits (``join_wait`` at most) for the DHT to join."""
        key = PROVIDER_PREFIX + group.name.encode()
        next_discovery, provided = 0.0, False
        greeting: set[bytes] = set()  # peers with a hello in flight

        async def greet(peer: bytes) -> None:
            try:
                await group.greet(PeerId(peer))
            finally:
                greeting.discard(peer)

        with group.cancel_scope:
            # Before the DHT has joined, the lookup finds nobody, and a member settling on that
            # trained rounds alone (a late joiner did, for 4 s, before it took the group's state)
            with trio.move_on_after(self.config.join_wait):
                await self._providers.joined.wait()
            async with trio.open_nursery() as background:
                while True:
                    now = trio.current_time()
                    if now >= next_discovery:
                        next_discovery = now + self.config.discover_interval
                        try:
                            if not provided:
                                provided = await self._providers.provide(key) > 0
                            for contact in await self._providers.find_providers(key, self.config.max_members):
                                group.heard_of(contact.public_key)
                        except DhtError as exc:
                            log.debug("%s: provider lookup failed: %s", group.tag, exc)
                    due = [peer for peer in group.to_greet() if peer not in greeting]
                    greeting.update(due)
                    if group.settled.is_set():
                        for peer in due:
                            background.start_soon(greet, peer)
                    else:
                        async with trio.open_nursery() as first:
                            for peer in due:
                                first.start_soon(greet, peer)
                        group.settled.set()
                    with trio.move_on_after(self.config.heartbeat_interval):
                        await group.wake.wait()
                    group.wake = trio.Event()

    # --- serving peers ---------------------------------------------------------------

    def _group_of(self, arg: object) -> Group:
        name = field(arg, "group", str)
        group = self.groups.get(name)
        if group is None:
            raise NotFound(f"this node is not in group {name!r:.60}")
        return group

    async def _serve_hello(self, arg, ctx) -> dict:
        group = self._group_of(arg)
        group.hello_from(ctx.peer, arg)
        if ctx.peer.key in group.view.members:
            self.memberships[group.name].heard(ctx.peer.key, arg.get("doc"))
        return group.hello()

    async def _serve_roster(self, arg, ctx) -> dict:
        return await self._group_of(arg).serve_roster(ctx.peer, arg)

    async def _serve_pull(self, arg, ctx):
        group = self._group_of(arg)
        kind = field(arg, "kind", str)
        if kind not in ("params", "state"):
            raise InvalidArgument("kind must be params or state")
        async for item in group.serve_pull(ctx.peer, kind, lane=arg.get("lane") is True):
            yield item

    async def _serve_state(self, arg, ctx) -> dict:
        return await self._group_of(arg).serve_state(ctx.peer)

    async def _serve_part(self, items, ctx) -> dict:
        first = await anext(items, None)
        group = self._group_of(first)
        return await group.serve_part(ctx.peer, first, items)

    async def _serve_bye(self, arg, ctx) -> dict:
        self._group_of(arg).serve_bye(ctx.peer, arg)
        return {}

    async def _serve_reduced(self, arg, ctx):
        group = self._group_of(arg)
        async for item in group.serve_reduced(ctx.peer, arg):
            yield item
