"""DiLoCo and gossip for a training script that uses a running daemon: the script's half.

::

    async with meshd.connect("~/.meshd") as client:      # a meshd already running (systemd, ...)
        opt = ml.DiLoCo(client, model, inner_opt=torch.optim.AdamW(model.parameters(), 3e-4),
                        group="run42", inner_steps=50)
        for x, y in loader:
            loss_fn(model(x), y).backward()
            await opt.step(samples=len(x))    # inner step here; every H steps an outer sync by the daemon
        await opt.aclose()                    # or leave ``connect``: the daemon leaves the group

``meshd.learning.DiLoCo`` and ``GossipAverager`` give these classes when
handed a client instead of a node.  The script takes its inner steps
itself; the daemon is the group's member for it and runs the in-process
algorithm over a shadow of the model (:mod:`meshd.services.learning.sessions`,
which also describes the call).  By default the shadow is shared memory (a
file the daemon makes and both map): at every outer sync (DiLoCo) or round
(gossip) the script copies its tensors into it, the call carries a few hundred
bytes of messages, and the script copies the answer's values out of it.
Where that cannot be (the daemon made no file, this process cannot map it),
or with ``shared_memory=False``, the model's tensors cross the control socket
instead, raw, once each way at the start and at every sync.  This module
imports torch; :mod:`meshd.client` itself does not import it.
"""

from __future__ import annotations

import mmap
import os
import stat

import torch
import trio

from learn.compress import encode
from learn.encoded import FLOATING
from learn.fragments import acting, overlap_steps, split
from learn.reports import GossipReport, SyncReport
from learn.robust import parse_rule
from learn.tensors import DTYPES, dtype_name
from learn.tensorset import SetDecoder, Specs, check_specs, shadow_layout, wire_specs
from learn.wire import WireError, frames

from ..rpc.errors import ProtocolViolation
from .base import ControlClient

METHOD = "learning.session"
GOSSIP_RULES = ("mean", "variance_corrected", "conservative")


class SessionClosed(Exception):
    """The session with the daemon is over (closed, or lost: its error says why); open a new one."""


class _Session:
    """One ``learning.session`` call: the model's tensors go out, the daemon's answers come in.

    ``tensors`` are the script's own (parameters, or ``state_dict`` entries).
    Over shared memory (``shared``, if the daemon offers a shadow and it maps
    here) they are copied into the shadow before each request and out of it
    after an answer that changed them, and only messages cross the socket.
    Over the socket they are sent as views where they are contiguous CPU
    tensors, and written from a reused staging buffer (one tensor at a time)
    when an answer brings values."""

    def __init__(self, client: ControlClient, arg: dict, tensors: dict[str, torch.Tensor], what: str, *,
                 shared: bool = True):
        self.client, self.arg, self.tensors, self.what = client, arg, tensors, what
        self.specs: Specs = check_specs(wire_specs({n: (dtype_name(t.dtype), tuple(t.shape))
                                                    for n, t in tensors.items()}))
        self.channel = self.stream = None
        self.closed: str | None = None  # why it is over
        self.shared = shared  # asks for a shared shadow
        self.memory: str | None = None  # once open: "shared" or "socket"
        self.memory_why: str | None = None  # why "socket", when shared memory was asked for
        self._shadow: dict[str, torch.Tensor] | None = None  # the shared shadow's views, by name
        self._mapping: mmap.mmap | None = None
        self._staging = bytearray()

    async def open(self) -> dict:
        """Start the call, send the script's values, return the daemon's first answer (the
        group's state is in the tensors by then)."""
        self.check_open()
        return await self._guarded(self._open())

    async def _open(self) -> dict:
        arg = {**self.arg, "tensors": wire_specs(self.specs)}
        if self.shared:
            arg["memory"] = "shared"
        self.channel, self.stream = await self.client.open_channel(METHOD, arg)
        if self.shared:
            offer = await self.channel.receive()
            if not isinstance(offer, dict) or "shadow" not in offer:
                raise ProtocolViolation(f"the daemon answered a shared-memory offer with {offer!r:.80}")
            self.memory_why = self._map(offer["shadow"], offer.get("why"))
            if self.memory_why is None:
                self.memory = "shared"
                self._write_shadow()  # the script's values: the group may take them
                await self.channel.send({"shadow": True})
                return await self._send_and_answer(None, tensors=False)
            await self.channel.send({"shadow": False, "why": self.memory_why})
        self.memory = "socket"
        return await self._send_and_answer(None)

    def _map(self, offer: object, why: object) -> str | None:
        """Map the shadow the daemon offers (None: it made none, ``why``); None once mapped,
        else why not.  The layout is this side's own (:func:`shadow_layout` of the specs),
        and the file must be a regular one of exactly its size that starts with the token."""
        if offer is None:
            return f"the daemon made no shared shadow ({str(why)[:200]})"
        _, size = shadow_layout(self.specs)
        if (not isinstance(offer, dict) or not isinstance(offer.get("path"), str)
                or not isinstance(offer.get("token"), bytes) or offer.get("size") != size):
            raise ProtocolViolation(f"the daemon offered a shadow as {offer!r:.120}")
        path, token = offer["path"], offer["token"]
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                    return f"{path} is not a {size}-byte file here"
                mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except OSError as exc:
            return f"cannot map {path}: {exc.strerror or exc}"
        if mapping[:len(token)] != token:  # another file of that name: another mount namespace, say
            mapping.close()
            return f"{path} here is not the daemon's shadow"
        self._mapping = mapping
        self._shadow = _views(mapping, self.specs)
        return None

    def _write_shadow(self, names=None) -> None:
        """The script's tensors (those of ``names``, default all) into the shadow (the
        daemon reads it only once the head is sent)."""
        with torch.no_grad():
            for name in self.tensors if names is None else names:
                self._shadow[name].copy_(self.tensors[name].detach())

    def _read_shadow(self, names=None) -> None:
        """The shadow's values (the daemon's answer; those of ``names``, default all) into
        the script's tensors."""
        with torch.no_grad():
            for name in self.tensors if names is None else names:
                self.tensors[name].copy_(self._shadow[name])

    def _unmap(self) -> None:
        self._shadow = None  # the views hold the mapping: it goes with them
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:  # a view is still referenced somewhere: unmapped when it goes
                pass
            self._mapping = None

    async def exchange(self, head: dict, *, tensors: bool = True, names=None) -> dict:
        """Send ``head`` and (with ``tensors``) every tensor; the daemon's answer (its tensors copied in).

        ``names``: the only tensors the daemon reads or writes for this head (a streaming
        sync's fragments): only they are sent (over shared memory, copied into the shadow),
        and only they come back unless the answer says ``replaced`` (a state taken: every
        tensor comes back)."""
        self.check_open()
        if tensors:
            count = len(self.tensors) if names is None else len(names)
            head = {**head, "tensors": 0 if self._shadow is not None else count}
        return await self._guarded(self._send_and_answer(head, tensors, names))

    def check_open(self) -> None:
        if self.closed is not None:
            raise SessionClosed(f"the {self.what} session is over ({self.closed}): make a new one")

    async def _guarded(self, work):
        """``work``, after which the call is in step; if it fails or is cancelled
        midway, the call is aborted (the daemon leaves the group) and the error raised."""
        try:
            return await work
        except BaseException as exc:
            self.abort(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            raise

    async def _send_and_answer(self, head: dict | None, tensors: bool = True, names=None) -> dict:
        channel = self.channel
        shared = self._shadow is not None
        if tensors and shared:
            self._write_shadow(names)  # before the head: the daemon reads the shadow once the head came
        if head is not None:
            await channel.send(head)
        if tensors and not shared:
            sent = self.tensors.items() if names is None else ((name, self.tensors[name]) for name in names)
            for frame in frames((name, encode(t.detach(), "none")) for name, t in sent):
                await channel.send(frame)
        answer = await channel.receive()
        state = answer.get("state") if isinstance(answer, dict) else None
        if not isinstance(state, dict):
            raise ProtocolViolation(f"the daemon answered a {self.what} session with {answer!r:.80}")
        if shared:
            if answer.get("tensors") != 0 or type(answer.get("changed")) is not bool:
                raise ProtocolViolation(f"the daemon answered a shared-memory {self.what} session with "
                                        f"{answer!r:.80}")
            if answer["changed"]:  # written before the answer; till the next head only a resync writes them
                self._read_shadow(None if state.get("replaced") else names)
            return state
        try:
            decoder = SetDecoder(self.specs, answer.get("tensors"), self._stage)
            while not decoder.done:
                for name in decoder.feed(await channel.receive()):
                    self._copy_in(name)
        except WireError as exc:
            raise ProtocolViolation(f"the daemon's tensors: {exc}") from None
        return state

    def _stage(self, name: str) -> memoryview:
        """Where tensor ``name``'s bytes land before they are copied into it (one buffer, reused)."""
        nbytes = self.tensors[name].numel() * self.tensors[name].element_size()
        if len(self._staging) < nbytes:
            self._staging = bytearray(nbytes)
        return memoryview(self._staging)[:nbytes]

    def _copy_in(self, name: str) -> None:
        target = self.tensors[name]
        nbytes = target.numel() * target.element_size()
        if not nbytes:  # an empty tensor: nothing came, nothing to copy
            return
        value = torch.frombuffer(self._staging, dtype=torch.uint8, count=nbytes).view(target.dtype).view(target.shape)
        with torch.no_grad():
            target.copy_(value)

    async def aclose(self) -> None:
        """End the session: the daemon leaves the group, then the call ends."""
        if self.closed is not None:
            return
        self.closed = "closed by this script"
        self._unmap()
        if self.channel is None:  # never opened
            return
        try:
            await self.channel.end()
            while True:  # the daemon ends its side once it has left
                await self.channel.receive()
        except trio.EndOfChannel:
            await self.stream.close()
        except BaseException:
            self.stream.abort()
            raise

    def abort(self, why: str) -> None:
        """Drop the call without a goodbye: the daemon cancels the session and leaves the group."""
        if self.closed is None:
            self.closed = why
            self._unmap()
            if self.stream is not None:
                self.stream.abort()


def _views(mapping: mmap.mmap, specs: Specs) -> dict[str, torch.Tensor]:
    """The tensors of ``specs`` in a shared shadow's mapping, each at its place."""
    places, _ = shadow_layout(specs)
    base = torch.frombuffer(mapping, dtype=torch.uint8)
    return {name: base[at:at + nbytes].view(DTYPES[dtype]).view(shape)
            for name, (dtype, shape) in specs.items() for at, nbytes in [places[name]]}


class _Remote:
    """What both algorithms' script halves share: the session, joining, and ending it."""

    _session: _Session

    def __init__(self, client: ControlClient, group: str):
        self._client, self.group_name = client, group
        self._joined = False

    async def join(self) -> None:
        """Open the session: the daemon's member joins the group (and greets its members)."""
        if not self._joined:
            self._joined = True
            self._take(await self._session.open())

    def _take(self, state: dict) -> None:
        pass

    async def live(self) -> int:
        """Live members of the group as the daemon's member hears them, itself included
        (for a script that waits for the others before its first step); joins first."""
        await self.join()
        rows = [g for g in await self._client.learning_groups() if g["group"] == self.group_name]
        return rows[0]["live"] if rows else 0

    async def aclose(self) -> None:
        """End the session: the daemon's member leaves the group."""
        await self._session.aclose()

    @property
    def memory(self) -> str | None:
        """How the tensors cross, once joined: ``"shared"`` (a shadow both processes map) or
        ``"socket"`` (then :attr:`memory_why` says why, if shared memory was asked for)."""
        return self._session.memory

    @property
    def memory_why(self) -> str | None:
        return self._session.memory_why

    async def __aenter__(self):
        await self.join()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


class RemoteDiLoCo(_Remote):
    """DiLoCo for ``model``, with the daemon behind ``client`` as the group's member.

    Takes :class:`meshd.learning.DiLoCo`'s arguments.  ``await step(samples)``
    after each backward: an inner step here, and every ``inner_steps`` steps an
    outer sync: the parameters go to the daemon, its DiLoCo runs the exchange,
    and θ comes back into the model.  With ``fragments`` P > 1 (Streaming
    DiLoCo) the parameters go to the daemon at each inner step where a
    fragment's exchange starts (the step returns at once: the exchange runs
    in the daemon while the script trains on) and at each one where it lands,
    after ``overlap`` more steps; then the fragment comes back mixed with θ_p.
    :meth:`join` opens the session (the daemon's member joins the group);
    :meth:`start`, or the first ``step``, copies the group's current θ into
    the model (joining first if need be).

    Mirrors of the daemon's member: ``steps``, ``version``, ``resyncs``,
    ``round``, ``hash``, ``hash_round`` and ``reports`` (:class:`SyncReport`),
    as of the last answer.  :meth:`aclose` (or ``async with``) ends the
    session; leaving :func:`meshd.connect`, or the script dying, ends it too.

    ``shared_memory`` (this class's own keyword): the shadow is shared memory
    if the daemon can make it and this process can map it (:attr:`memory`
    says which it is); False sends the tensors over the control socket.
    ``in_place`` is taken and has no effect: the script's model is never the
    sync's buffer here (the daemon's member decides for the shadow).
    ``island``: the processes this script's model stands for (its
    :class:`meshd.learning.IslandDiLoCo` says), shown in the group's document.
    """

    def __init__(self, client: ControlClient, model: torch.nn.Module, *, inner_opt: torch.optim.Optimizer,
                 group: str, inner_steps: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 fragments: int = 1, overlap: int | None = None, alpha: float = 0.5, compression: str = "none",
                 block: int = 64, rule: str = "mean", shared_memory: bool = True, in_place: bool = True,
                 island: int = 1):
        del in_place  # the script's model is never the sync's buffer here: the daemon holds its own
        overlap = overlap_steps(inner_steps, fragments, overlap)  # bad values fail here, not at a step
        parse_rule(rule)
        super().__init__(client, group)
        self.model, self.inner_opt, self.H, self.P, self.overlap = model, inner_opt, inner_steps, fragments, overlap
        params = dict(model.named_parameters())
        odd = [n for n, p in params.items() if dtype_name(p.dtype) not in FLOATING]
        if odd:
            raise ValueError(f"DiLoCo trains floating parameters; {odd[0]} is {params[odd[0]].dtype}")
        self._fragments = split(list(params), fragments)  # as the daemon's DiLoCo splits the shadow
        self._session = _Session(client, {
            "algorithm": "diloco", "group": group, "inner_steps": inner_steps, "outer_lr": outer_lr,
            "outer_momentum": outer_momentum, "fragments": fragments, "overlap": overlap, "alpha": alpha,
            "compression": compression, "block": block, "rule": rule, "island": island}, params, "DiLoCo",
            shared=shared_memory)
        self._started = False
        self.steps = 0  # inner steps, in the group's count (the daemon's DiLoCo sets it when it takes a state)
        self.samples = 0  # samples since the last sync
        self._pending = 0  # inner steps since the last sync
        self.version = 0  # moves whenever θ came in (an outer step, a state taken)
        self.resyncs = 0
        self.round = 0
        self.hash: bytes | None = None
        self.hash_round = -1
        self.reports: list[SyncReport] = []

    async def start(self) -> None:
        """Join if not yet, and take the group's state: the model holds the group's θ
        (the first :meth:`step` does this)."""
        await self.join()
        if not self._started:
            self._started = True
            self._take(await self._session.exchange({"start": {}}, tensors=False))

    async def settle(self) -> None:
        """After the last :meth:`step`: the daemon ends in the group's state
        (:meth:`meshd.learning.DiLoCo.settle`), and the model holds it."""
        await self.start()
        self._take(await self._session.exchange({"settle": {}}, tensors=False))

    async def step(self, samples: int = 0) -> None:
        """One inner step (then ``zero_grad``); every ``inner_steps`` steps, the outer sync.
        SessionClosed once the session is over (before the inner step)."""
        self._session.check_open()
        if not self._started:
            await self.start()
        await trio.lowlevel.checkpoint()
        self.inner_opt.step()
        self.inner_opt.zero_grad(set_to_none=True)
        self.steps += 1
        self._pending += 1
        self.samples += samples
        parts = acting(self.steps, self.H, self.P, self.overlap)
        if parts:
            names = None if self.P == 1 else [n for p in parts for n in self._fragments[p]]
            state = await self._session.exchange({"sync": {"steps": self._pending, "samples": self.samples}},
                                                 names=names)
            self._pending = self.samples = 0
            self._take(state)

    def _take(self, state: dict) -> None:
        try:
            self.steps, self.version, self.resyncs = state["steps"], state["version"], state["resyncs"]
            self.round, self.hash, self.hash_round = state["round"], state["hash"], state["hash_round"]
            self.reports += [SyncReport(*r) for r in state["reports"]]
        except (KeyError, TypeError) as exc:
            raise ProtocolViolation(f"the daemon's DiLoCo state lacks {exc}") from None


class RemoteGossipAverager(_Remote):
    """Gossip averaging for ``model``, with the daemon behind ``client`` as the group's member.

    Takes :class:`meshd.learning.GossipAverager`'s arguments.  ``await
    step(samples)`` after a round's local epochs sends the model's
    ``state_dict`` to the daemon, which offers it, pulls ``partners`` live
    members' and merges them (its GossipAverager over a shadow), and the merged
    values come back into the model.  :meth:`join`, :meth:`live`,
    :meth:`aclose` and ``shared_memory`` as for :class:`RemoteDiLoCo`."""

    def __init__(self, client: ControlClient, model: torch.nn.Module, *, group: str,
                 rule: str = "variance_corrected", partners: int = 4, c: float = 0.5, compression: str = "none",
                 block: int = 64, weighted: bool = False, seed: int | None = None, shared_memory: bool = True):
        if rule not in GOSSIP_RULES:
            raise ValueError(f"rule must be one of {', '.join(GOSSIP_RULES)}, not {rule!r}")
        super().__init__(client, group)
        self.model = model
        self._session = _Session(client, {
            "algorithm": "gossip", "group": group, "rule": rule, "partners": partners, "c": c,
            "compression": compression, "block": block, "weighted": weighted, "seed": seed},
            model.state_dict(), "gossip", shared=shared_memory)
        self.round = 0

    async def step(self, samples: int = 0) -> GossipReport:
        """Offer this model, pull up to ``partners`` live members' and merge them in."""
        await self.join()
        state = await self._session.exchange({"step": {"samples": samples}})
        self._take(state)
        try:
            return GossipReport(*state["report"])
        except (KeyError, TypeError) as exc:
            raise ProtocolViolation(f"the daemon's gossip report: {exc}") from None

    def _take(self, state: dict) -> None:
        if type(state.get("round")) is not int:
            raise ProtocolViolation("the daemon's gossip state lacks its round")
        self.round = state["round"]
