"""Training sessions: DiLoCo or gossip for a training script that runs no node of its own.

A script that uses a running daemon (``meshd.learning.DiLoCo(client, model, ...)``
with a client of :func:`meshd.connect`) takes its inner steps itself, and the
daemon is the group's member for it.  One control call, ``learning.session``
(bidirectional), is the whole session: the daemon keeps a *shadow* of the
script's model, tensors with its parameter names, dtypes and shapes (no
module), and runs the very :class:`~.diloco.DiLoCo` (or
:class:`~.averager.GossipAverager`) an in-process script would, over the
shadow.  So rosters, reductions, the hash check, resyncs, offering the state
to joiners and shard sync are the in-process code, unchanged, and a script's
θ is bit-identical to every other member's.

The call, each item a msgpack map (tensors as :mod:`learn.wire` frames of raw
bytes, dtype and shape; never pickled; checked by :class:`learn.tensorset.SetDecoder`):

* the request names the algorithm, the group, the algorithm's options and the
  tensors (``[name, dtype, shape]`` each); the script then sends every
  tensor's value.  The daemon joins the group and answers ``{"state": {...},
  "tensors": 0}`` (a script may now wait for the members it wants live).
* with ``"memory": "shared"`` in the request, the shadow is shared memory
  instead (:mod:`.shadows`): the daemon first offers ``{"shadow": {"path",
  "token", "size"}}`` (or ``{"shadow": None, "why": ...}`` if it could make
  no file), a file laid out by :func:`learn.tensorset.shadow_layout` of the
  checked specs (the script sends no size or offset: both sides compute the
  layout), and the script answers ``{"shadow": true}`` once it mapped it
  and wrote its values in (the daemon then removes the file: both keep their
  mappings), or ``{"shadow": false, "why": ...}`` and sends its values as
  above: the session goes over the socket.  Over shared memory every head
  below says ``"tensors": 0`` (the script wrote them into the shadow before
  sending it), and every answer is ``{"state": {...}, "tensors": 0,
  "changed": bool}``: whether the shadow holds values the script must copy
  out.  Who touches the shadow when: the script writes it only before a
  head and reads it only after an answer; the daemon reads and writes it
  only between a head and its answer, except a state taken from another
  member in the background (a resync), which writes θ into it at any time
  and makes the next sync's answer ``replaced`` (the whole shadow rewritten:
  anything the script wrote or read meanwhile is moot).  A script that
  breaks the rule (writes during an exchange) makes at worst its own
  contribution wrong: θ, the momentum and the hash are the daemon's own
  memory, and what it reads from the shadow is numbers like any upload.
* DiLoCo: ``{"start": {}}`` before the first inner step: the daemon takes the
  group's state (:meth:`DiLoCo.start`) and answers ``{"state": {...},
  "tensors": n}`` and n tensors: the values the script must hold before its
  first step (n = 0 if its own are the group's).
* DiLoCo: ``{"settle": {}}`` after the last inner step: the daemon ends in
  the group's state (:meth:`DiLoCo.settle`) and answers as to a start.
* per outer sync (DiLoCo) or round (gossip) the script sends ``{"sync":
  {"steps": k, "samples": s}, "tensors": n}`` (``"step"`` for gossip) and
  its n tensors; the daemon takes the k inner steps' place in DiLoCo's count
  (the last one runs the exchange), and answers as above, with the tensors
  it changed (all of them after an outer step, none if nothing changed).
  Streaming DiLoCo (``fragments`` P > 1) syncs at every inner step where a
  fragment's exchange starts (its Δ is taken from the tensors sent then, and
  the exchange runs in the daemon while the script trains on) and at every
  one where a fragment's exchange lands (:func:`learn.fragments.lands`: θ_p
  mixed into the tensors sent then), so the script's model gets what an
  in-process member's would at the same step; only those fragments' tensors
  cross, each way (over the socket n is their count; over shared memory the
  script copies only them in and out), all of them when the answer says
  ``replaced``.  If the daemon took another member's state
  since its last answer (a resync), the script's tensors are stale: they are
  dropped, no exchange runs, and the answer carries the state taken
  (``replaced``); an answer is ``replaced`` too when a state was taken while
  the head was served.
* the session ends when the script ends its side, or its connection is
  lost (the script died): the call is cancelled, and the daemon leaves the
  group (:meth:`Learning.leave`) as a script's node does when it closes
  (a shared shadow's file is gone by then; its mapping goes with the session).

One session per group on a node: a node is one member of a group.
"""

from __future__ import annotations

import logging
import math
import time

import torch
import trio

from learn.compress import encode
from learn.encoded import CODECS, FLOATING, ITEMSIZE, check_block
from learn.fragments import acting, overlap_steps, split
from learn.membership import MAX_ISLAND
from learn.robust import parse_rule
from learn.tensors import DTYPES, tensor_view
from learn.tensorset import SetDecoder, Specs, check_specs, shadow_layout
from learn.wire import Limits, WireError, frames

from ...rpc import InvalidArgument, RpcError
from ...rpc.args import field, optional
from ...service import check_name
from . import shadows
from .averager import RULES as GOSSIP_RULES
from .averager import GossipAverager
from .diloco import DiLoCo

log = logging.getLogger("meshd.learning")

ALGORITHMS = ("diloco", "gossip")
MEMORY = ("socket", "shared")  # how a session's tensors cross: frames on the call, or a shared shadow


class _Shadow:
    """The script's model as the daemon holds it: its tensors, by name, and nothing else."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def named_parameters(self):
        return iter(self.tensors.items())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in state.items():
                self.tensors[name].copy_(value)


class _NoInnerSteps:
    """The inner optimizer of a shadow: the script takes the inner steps."""

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


class _SessionService:
    """What DiLoCo and GossipAverager see as the node and its learning service: the
    service itself, except that their background tasks run in the session's nursery
    (they end with the session)."""

    def __init__(self, learning, nursery: trio.Nursery):
        self._learning = learning
        self._nursery = nursery
        self.config = learning.config

    def service(self, name: str) -> _SessionService:
        return self

    def join(self, name: str, *, algorithm: str, rule: str):
        return self._learning.join(name, algorithm=algorithm, rule=rule)

    def membership(self, name: str):
        return self._learning.membership(name)

    def spawn(self, fn, *args) -> None:
        self._nursery.start_soon(fn, *args)


def _number(arg: dict, name: str, kind: type, low: float, high: float, default):
    value = optional(arg, name, kind)
    if value is None:
        return default
    if isinstance(value, bool) or not low <= value <= high or (isinstance(value, float) and not math.isfinite(value)):
        raise InvalidArgument(f"{name} must be from {low} to {high}, not {value!r:.20}")
    return value


def _options(algorithm: str, arg: dict, specs: Specs) -> dict:
    """The algorithm's keywords from the request, each checked (InvalidArgument naming it),
    before any tensor's value comes; a missing one takes the algorithm's default."""
    compression = optional(arg, "compression", str) or "none"
    if compression not in CODECS:
        raise InvalidArgument(f"compression must be one of {', '.join(CODECS)}, not {compression!r:.40}")
    common = {"compression": compression, "block": _number(arg, "block", int, 64, 1024, 64)}
    try:
        check_block(common["block"])
        if algorithm == "diloco":
            rule = optional(arg, "rule", str) or "mean"
            parse_rule(rule)
            options = {"inner_steps": _number(arg, "inner_steps", int, 1, 1 << 30, 50),
                       "outer_lr": _number(arg, "outer_lr", (int, float), 0, 1e6, 0.7),
                       "outer_momentum": _number(arg, "outer_momentum", (int, float), 0, 1, 0.9),
                       "fragments": _number(arg, "fragments", int, 1, 1 << 30, 1),
                       "overlap": _number(arg, "overlap", int, 1, 1 << 30, None),
                       "alpha": _number(arg, "alpha", (int, float), 0, 1, 0.5), "rule": rule, **common}
            overlap_steps(options["inner_steps"], options["fragments"], options["overlap"])
            options["island"] = _number(arg, "island", int, 1, MAX_ISLAND, 1)
            split(list(specs), options["fragments"])  # as DiLoCo will: no more fragments than layers
            return options
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    rule = optional(arg, "rule", str) or "variance_corrected"
    if rule not in GOSSIP_RULES:
        raise InvalidArgument(f"rule must be one of {', '.join(GOSSIP_RULES)}, not {rule!r:.40}")
    return {"rule": rule, "partners": _number(arg, "partners", int, 1, 1024, 4),
            "c": _number(arg, "c", (int, float), 0, 1, 0.5), "weighted": bool(optional(arg, "weighted", bool)),
            "seed": _number(arg, "seed", int, 0, (1 << 63) - 1, None), **common}


async def _receive(channel, specs: Specs, tensors: dict[str, torch.Tensor], count: int, limits: Limits) -> int:
    """``count`` of the script's tensors, written straight into ``tensors``; their bytes."""
    decoder = SetDecoder(specs, count, lambda name: tensor_view(tensors[name], writable=True), limits)
    try:
        while not decoder.done:
            try:
                frame = await channel.receive()
            except trio.EndOfChannel:
                raise InvalidArgument(f"the script ended its side inside a transfer ({len(decoder.names)} "
                                      f"of {count} tensors came)") from None
            decoder.feed(frame)
    except WireError as exc:
        raise InvalidArgument(str(exc)) from None
    return sum(math.prod(specs[n][1]) * ITEMSIZE[specs[n][0]] for n in decoder.names)


class _SharedShadow:
    """The shadow's tensors in a file the script maps too (:mod:`.shadows`): views of the
    daemon's mapping at the places :func:`shadow_layout` gives for the specs, the daemon's
    own (never the script's) reading of them."""

    def __init__(self, mapping, specs: Specs):
        places, _ = shadow_layout(specs)
        base = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping: unmapped when the views go
        self.tensors = {name: base[at:at + nbytes].view(DTYPES[dtype]).view(shape)
                        for name, (dtype, shape) in specs.items() for at, nbytes in [places[name]]}


async def _share(learning, channel, specs: Specs) -> _SharedShadow | None:
    """Offer the script a shared shadow for ``specs``; the shadow, once the script says it
    mapped it and wrote its values in, else None (no file could be made, or the script
    could not map it: the tensors then come over the socket).  The file is gone when
    this returns, or raises (the script dropped the call meanwhile)."""
    _, size = shadow_layout(specs)
    try:  # in a thread: allocating a large model's pages takes a while (not cancelled midway: see below)
        path, token, mapping = await trio.to_thread.run_sync(shadows.create, learning.host.data_dir, size)
    except OSError as exc:
        log.info("a %d-byte training session goes over the socket: %s", size, exc)
        await channel.send({"shadow": None, "why": str(exc)})
        await _reply(channel)
        return None
    try:  # a cancellation during the thread lands at the send: the file goes all the same
        shadow = _SharedShadow(mapping, specs)
        await channel.send({"shadow": {"path": str(path), "token": token, "size": size}})
        mapped, why = await _reply(channel)
    finally:
        shadows.remove(path)  # mapped by both by now, or never will be: nothing else may open it
    if mapped:
        return shadow
    log.info("a training script could not map its shared shadow (%s): its session goes over the socket", why)
    return None


async def _reply(channel) -> tuple[bool, str]:
    """The script's answer to a shadow offer: whether it mapped it (and wrote its values), and why not."""
    try:
        reply = await channel.receive()
    except trio.EndOfChannel:
        raise InvalidArgument("the script ended its side before answering the shared-memory offer") from None
    mapped = field(reply, "shadow", bool)
    return mapped, str(optional(reply, "why", str) or "")[:200]


class Session:
    """One script's session: its shadow tensors and the algorithm over them."""

    def __init__(self, learning, nursery: trio.Nursery, group: str, algorithm: str, specs: Specs,
                 tensors: dict[str, torch.Tensor], options: dict, *, shared: bool = False):
        self.group_name, self.algorithm, self.specs, self.tensors = group, algorithm, specs, tensors
        self.shared = shared  # the tensors are a shadow the script maps too: no tensor crosses the socket
        self.limits = Limits(max_bytes=learning.config.max_bytes)
        self.opened = time.time()
        self.syncs = 0  # outer syncs (DiLoCo) or rounds (gossip) the script asked for
        self.bytes_in = self.bytes_out = 0  # tensor bytes over the control socket, both ways
        host = _SessionService(learning, nursery)
        if algorithm == "diloco":
            island = options.pop("island")
            self.opt = DiLoCo(host, _Shadow(tensors), inner_opt=_NoInnerSteps(), group=group, **options)
            self.opt.membership.report(island=island)  # the processes the script's model stands for
        else:
            self.opt = GossipAverager(host, _Shadow(tensors), group=group, **options)
        self.group = self.opt.group
        self._version = 0  # DiLoCo: its version when the script was last sent the tensors
        self._takes = 0  # DiLoCo: states taken from other members, as of the last answer
        self._reports = 0  # DiLoCo: its reports already sent

    # --- the call --------------------------------------------------------------------------

    async def run(self, channel) -> None:
        """Say it joined, then answer each start or sync the script asks for until it ends its side."""
        await self._answer(channel, replaced=False, changed=False)
        while True:
            try:
                head = await channel.receive()
            except trio.EndOfChannel:
                return
            if self.algorithm == "diloco" and isinstance(head, dict) and head.keys() in ({"start"}, {"settle"}):
                await (self.opt.start() if "start" in head else self.opt.settle())  # the group's state, if not ours
                await self._answer(channel, replaced=False, changed=self.opt.version != self._version)
                continue
            key = "sync" if self.algorithm == "diloco" else "step"
            sync = field(head, key, dict)
            count = field(head, "tensors", int)
            samples = _number(sync, "samples", int, 0, (1 << 63) - 1, 0)
            steps = _number(sync, "steps", int, 1, self.opt.H, None) if self.algorithm == "diloco" else 0
            if steps is None:
                raise InvalidArgument(f"a sync says how many inner steps (1 to {self.opt.H}) it follows")
            # The tensors this sync carries (None: every one); after a state taken here the script
            # counted its steps from another place, so any of its tensors will do (they are dropped).
            names = self._acting(steps)
            stale = names is not None and self._stale()
            specs = self.specs if names is None or stale else {n: self.specs[n] for n in names}
            expected = 0 if self.shared else None if stale else len(specs)
            if expected is not None and count != expected:
                raise InvalidArgument(f"a {key} of a shared-memory session sends no tensors, not {count}"
                                      if self.shared else f"this {key} sends {expected} tensors, not {count}")
            self.syncs += 1
            if not self.shared:  # shared: the script wrote them into the shadow before it sent the head
                self.bytes_in += await _receive(channel, specs, self.tensors, count, self.limits)
            if self.algorithm == "gossip":
                report = await self.opt.step(samples)
                await self._answer(channel, replaced=False, changed=report.merged > 0, report=[
                    report.round, report.partners, report.merged, report.bytes_in, report.seconds])
            else:
                await self._sync(channel, steps, samples, names)

    def _acting(self, steps: int) -> list[str] | None:
        """The tensors a Streaming DiLoCo sync after ``steps`` more inner steps acts on: those of
        the fragments whose exchange starts or lands then (what a socket sync carries each way);
        None for a sync of every tensor (DiLoCo without fragments, gossip)."""
        opt = self.opt
        if self.algorithm != "diloco" or opt.P == 1:
            return None
        return [name for p in acting(opt.steps + steps, opt.H, opt.P, opt.overlap) for name in opt.fragments[p]]

    def _stale(self) -> bool:
        """Whether the daemon's DiLoCo took a state since the script's last tensors (so the
        script counted its steps from another place, and what it sends is dropped)."""
        return sum(self.opt.takes.values()) != self._takes

    async def _sync(self, channel, steps: int, samples: int, names: list[str] | None) -> None:
        opt = self.opt
        if self._stale():  # a resync since the script's last tensors: they are stale
            with torch.no_grad():
                for name, tensor in self.tensors.items():
                    tensor.copy_(opt.theta[name])  # as the resync left them (the upload wrote over them)
            await self._answer(channel, replaced=True, changed=True)
            return
        for i in range(steps):  # the script's inner steps, in DiLoCo's count: the last one syncs
            await opt.step(samples if i == 0 else 0)
        # a state taken meanwhile rewrote every tensor: the script copies them all, not only its fragments
        replaced = self._stale()
        await self._answer(channel, replaced=replaced, changed=opt.version != self._version,
                           names=None if replaced else names)

    async def _answer(self, channel, *, replaced: bool, changed: bool, report: list | None = None,
                      names: list[str] | None = None) -> None:
        """The state the script mirrors, then the tensors it must copy in (none, ``names``
        (a streaming sync's fragments: the socket carries only them), or all)."""
        state: dict = {"replaced": replaced}
        if isinstance(self.opt, DiLoCo):
            opt, group = self.opt, self.group
            self._version, self._takes = opt.version, sum(opt.takes.values())  # before sending: see _sync
            state.update(steps=opt.steps, version=opt.version, resyncs=opt.resyncs, round=group.round,
                         hash=group.hash, hash_round=group.hash_round,
                         reports=[[r.round, r.fragment, r.contributors, r.missing_values, r.bytes_out, r.seconds]
                                  for r in opt.reports[self._reports:]])
            self._reports = len(opt.reports)
        else:
            state.update(round=self.group.round, report=report)
        if self.shared:  # the values are in the shadow already: the script copies them out if changed
            await channel.send({"state": state, "tensors": 0, "changed": changed})
            return
        sent = {} if not changed else self.tensors if names is None else {n: self.tensors[n] for n in names}
        await channel.send({"state": state, "tensors": len(sent)})
        for frame in frames((name, encode(tensor, "none")) for name, tensor in sent.items()):
            await channel.send(frame)
        self.bytes_out += sum(t.numel() * t.element_size() for t in sent.values())

    def status(self) -> dict:
        return {"algorithm": self.algorithm, "memory": "shared" if self.shared else "socket",
                "opened": self.opened, "syncs": self.syncs,
                "tensors": len(self.specs), "bytes": sum(t.numel() * t.element_size() for t in self.tensors.values()),
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}


def _not_in(learning, group: str) -> None:
    if group in learning.groups:
        raise InvalidArgument(f"this node is already in group {group!r}: a node is one member of a group "
                              "(a second member needs a daemon of its own)")


async def serve_session(learning, channel, ctx) -> None:
    """``learning.session``: one training script's session, until it ends (see the module)."""
    arg = channel.arg
    algorithm = field(arg, "algorithm", str)
    if algorithm not in ALGORITHMS:
        raise InvalidArgument(f"algorithm must be one of {', '.join(ALGORITHMS)}, not {algorithm!r:.40}")
    limits = Limits(max_bytes=learning.config.max_bytes)
    try:
        group = check_name(field(arg, "group", str), "a group name")  # as Learning.join checks it
        specs = check_specs(arg.get("tensors"), limits, dtypes=FLOATING if algorithm == "diloco" else tuple(DTYPES))
    except (ValueError, WireError) as exc:
        raise InvalidArgument(str(exc)) from None
    memory = optional(arg, "memory", str) or "socket"
    if memory not in MEMORY:
        raise InvalidArgument(f"memory must be one of {', '.join(MEMORY)}, not {memory!r:.40}")
    options = _options(algorithm, arg, specs)
    _not_in(learning, group)
    shadow = await _share(learning, channel, specs) if memory == "shared" else None
    if shadow is not None:  # the script wrote its values into it
        tensors, received = shadow.tensors, 0
    else:
        tensors = {name: torch.empty(shape, dtype=DTYPES[dtype]) for name, (dtype, shape) in specs.items()}
        received = await _receive(channel, specs, tensors, len(specs), limits)  # its values: the group may take them
    refused: RpcError | None = None
    async with trio.open_nursery() as nursery:
        try:
            _not_in(learning, group)  # nobody joined while they came (nothing awaits from here to the join)
            try:
                session = Session(learning, nursery, group, algorithm, specs, tensors, options,
                                  shared=shadow is not None)
            except BaseException as exc:
                learning.leave(group)  # in case it got as far as joining
                if isinstance(exc, ValueError):
                    raise InvalidArgument(str(exc)) from None
                raise
            session.bytes_in = received
            learning.sessions[group] = session
            try:
                await session.run(channel)
            finally:
                nursery.cancel_scope.cancel()
                del learning.sessions[group]
                learning.leave(group)
        except RpcError as exc:  # the script's error: raised as itself, not in the nursery's group (INTERNAL)
            refused = exc
    if refused is not None:
        raise refused
