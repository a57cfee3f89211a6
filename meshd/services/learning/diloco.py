"""DiLoCo and Streaming DiLoCo: H local steps, then one outer step every member agrees on.

From the shared parameters θ each member takes ``inner_steps`` (H) steps with
its own optimizer; its pseudo-gradient is Δ = θ − θ_local.  The group
averages the round's Δs with :meth:`Group.allreduce` (each slice reduced once,
by one member, so every member receives the same values) and every member
applies the same fp32 Nesterov step (:class:`learn.outer.OuterSGD`), so every
member that took part ends the round with bit-identical θ and momentum.  It
then publishes blake3(θ, momentum); a member whose hash differs from the
majority's, or that joins, takes the whole state from a member that agrees:
over shard sync when this node runs the ``shards`` service and the state is
large (``[learning] shard_sync_min_bytes``; fetched into memory from every
member holding the same bits, checked against the hash), else, or if that
fails, over ``learning.pull``.

With ``fragments`` P > 1 (Streaming DiLoCo) θ is split into P strided
fragments; fragment p's exchange starts at the inner steps ≡ (p+1)·H/P (mod H),
runs in the background for ``overlap`` (τ) further inner steps, and then
θ_p,local ← α·θ_p,local + (1−α)·θ_p,global, so one fragment is in flight at a
time and peak bandwidth drops by P.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import Counter

import torch
import trio

from learn.compress import decode, encode
from learn.fragments import due, mix, overlap_steps, split
from learn.outer import OuterSGD, state_hash
from learn.reports import SyncReport
from learn.robust import aggregate, parse_rule

from ...identity import PeerId
from ...rpc import RpcError

log = logging.getLogger("meshd.learning")
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)


def _joined(theta: dict, momentum: dict) -> dict:
    """θ and the outer momentum as one set of named tensors (``theta/NAME``, ``momentum/NAME``): a whole state."""
    return {**{f"theta/{n}": t for n, t in theta.items()}, **{f"momentum/{n}": t for n, t in momentum.items()}}


def _split(tensors: dict) -> tuple[dict, dict]:
    """(θ, momentum) of a whole state named as :func:`_joined` names it."""
    parts: tuple[dict, dict] = ({}, {})
    for name, tensor in tensors.items():
        kind, _, param = name.partition("/")
        if kind in ("theta", "momentum"):
            parts[kind == "momentum"][param] = tensor
    return parts


def _trim() -> None:
    """Give the heap's free memory back to the system (glibc's ``malloc_trim``; nothing
    elsewhere): after an exchange the heap held about one model's size it had freed,
    which the next exchange did not reuse, so each member's peak was that much higher."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as float32 in host memory: itself if it is that already, else a copy
    (a parameter on a GPU: θ, the momentum and the exchange live on the host)."""
    return tensor.detach().to("cpu", torch.float32)


def _flatten(params: list) -> torch.Tensor | None:
    """Make ``params`` views, in order, of one new float32 vector holding their values,
    and return it; None (nothing changed) unless each is a float32 CPU tensor that
    owns all of its own memory and is not shared (with another process, or with
    another tensor: a view or a tied weight)."""
    storages = set()
    for p in params:
        storage = p.untyped_storage()
        if (p.dtype != torch.float32 or p.device.type != "cpu" or p.is_shared() or not p.is_contiguous()
                or p.storage_offset() or storage.nbytes() != p.numel() * 4 or storage.data_ptr() in storages):
            return None
        storages.add(storage.data_ptr())
    return _rebind(params, params)


def _rebind(params: list, values: list) -> torch.Tensor:
    """Make ``params`` views, in order, of one new float32 vector holding ``values``
    (tensors of their shapes), and return it."""
    flat = torch.empty(sum(p.numel() for p in params))
    at = 0
    with torch.no_grad():
        for p, value in zip(params, values):
            view = flat[at:at + p.numel()].view_as(p)
            view.copy_(value)
            p.data = view
            at += p.numel()
    return flat


class DiLoCo:
    """DiLoCo for ``model`` in group ``group``: ``await step(samples)`` after each backward.

    With ``in_place`` (the default) and one fragment, the model's parameters
    become views of one float32 vector (when each is a float32 CPU tensor of
    its own, not shared) and a sync uses them as its buffer: they hold Δ and
    then the average while ``step`` awaits the exchange, and θ when it
    returns, which saves a copy of the model.  Anything that reads the
    parameters during that await (another task, a tensor taken from
    ``param.data`` before this call) sees those values or the old storage;
    ``in_place=False`` keeps a vector of its own instead.  If the exchange is
    cancelled or fails, the parameters are set back to θ.  If a state is taken
    from another member meanwhile, ``step`` returns at once with the
    parameters holding its θ (a new vector), and the exchange, moot here, goes
    on in the background with its own: others may fetch the slice it reduces.

    θ, the outer momentum and what an exchange moves live in host memory
    wherever the model is (a model on a GPU: Δ is copied off it at a sync, θ
    onto it after the outer step), so a GPU holds the model and its inner
    optimizer only, as in OpenDiLoCo's offloaded outer step.
    """

    def __init__(self, node, model: torch.nn.Module, *, inner_opt: torch.optim.Optimizer, group: str,
                 inner_steps: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 fragments: int = 1, overlap: int | None = None, alpha: float = 0.5,
                 compression: str = "none", block: int = 64, rule: str = "mean", in_place: bool = True):
        parse_rule(rule)  # a bad rule fails here, not at the first sync
        self._service = node.service("learning")  # the Learning service, or a daemon session's view of it
        self.model, self.inner_opt = model, inner_opt
        self.H, self.P, self.alpha = inner_steps, fragments, alpha
        self.overlap = overlap_steps(inner_steps, fragments, overlap)
        self.compression, self.block, self.rule = compression, block, rule
        self._params = dict(model.named_parameters())
        self.fragments = split(list(self._params), fragments)
        # P = 1: the parameters, views of one vector in name order, hold Δ and then the average during a sync
        self._flat = _flatten([self._params[n] for n in sorted(self._params)]) if in_place and fragments == 1 else None
        # θ and the momentum in host memory, wherever the model is: a GPU keeps only the model
        self.theta = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in self._params.items()}
        self.outer = OuterSGD(lr=outer_lr, momentum=outer_momentum, nesterov=True)
        self.group = self._service.join(group, algorithm="streaming-diloco" if fragments > 1 else "diloco",
                                        rule=rule)
        self.membership = self._service.membership(group)  # where steps, samples and role are reported
        self.steps = 0  # inner steps taken
        self.samples = 0  # samples since the last exchange
        self.reports: list[SyncReport] = []
        self.resyncs = 0  # states taken from another member after the start
        self.takes: Counter = Counter()  # states taken from another member, by path: "shards" or "pull"
        self.taken_states: list[dict] = []  # each: path, round, peer, seconds, bytes (tensor bytes)
        self._offered: tuple[int, int] = (0, 0)  # (version, round) of the state offered last
        self.version = 0  # bumped whenever θ is written outside the inner step (an outer step, a resync)
        self._taken = 0  # states taken from others: an exchange begun before one is not applied after it
        self._resyncing: trio.Event | None = None  # set once the state being taken from a member is applied
        self._solo = False  # the last exchange used no contribution but this member's
        self._residual: dict[int, torch.Tensor] = {}  # error feedback, per fragment
        self._buffers: dict[int, torch.Tensor] = {}  # fragment -> its Δ vector, reused (the average lands in it)
        self._inflight: dict[int, tuple[int, trio.Event, dict]] = {}  # fragment -> (apply at, done, out)
        self._syncing: trio.Event | None = None  # a blocking sync waits on it (set: it returns)
        self._sync_round: int | None = None  # the round of that sync
        self._writing: trio.Event | None = None  # set once a worker thread writing Δ or θ is done
        self._started = False
        self._offer_state()  # a member that joins before our first step can take it already
        self.group.state_source = self._shared_state  # what learning.state publishes over shard sync

    # --- the training loop's one call --------------------------------------------------------

    async def step(self, samples: int = 0) -> None:
        """One inner optimizer step (then ``zero_grad``); the outer exchange when due.

        Every call lets the node run a moment (hellos, peers' requests), so a
        training loop in the node's own process does not go silent to the
        group between outer exchanges."""
        if not self._started:
            await self._start()
        await trio.lowlevel.checkpoint()
        self.inner_opt.step()
        self.inner_opt.zero_grad(set_to_none=True)
        self.steps += 1
        self.samples += samples
        self.membership.report(steps=1, samples=samples)
        if self.P == 1:
            if self.steps % self.H == 0:
                await self._sync(0)
            return
        for p in due(self.steps, self.H, self.P):
            await self._begin(p)
        for p, (apply_at, done, out) in list(self._inflight.items()):
            if self.steps >= apply_at:
                await done.wait()
                del self._inflight[p]
                await self._land(p, out, streaming=True)

    async def settle(self) -> None:
        """End a run in the group's state: wait (up to three heartbeats) for the live
        members' hashes of this member's last round, and take the majority's state if
        this member's differs (returning once it is applied).  Call it after the last
        :meth:`step`: a member whose last exchange missed a slice the others had ends
        that round with another θ, and no later round's check puts it right."""
        await self._check_hash()

    # --- joining ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Take the group's state now, unless done already (the first :meth:`step` does it
        otherwise): a daemon's session for a training script hands θ out before its first step."""
        if not self._started:
            await self._start()

    async def _start(self) -> None:
        """Hear the group once, and take the state of its source (:meth:`Group.source`:
        the member furthest ahead whose state another holds too) if that is not us."""
        self._started = True
        group = self.group
        await group.settled.wait()
        source, _ = group.source()
        if source != group.me:
            await self._resync(source)
        elif group.joined is None:  # the group's state is ours: contribute from this round, and say so now
            group.joined = group.round
            group.wake.set()

    def _offer_state(self, round_: int | None = None, *, hashed: bool = True) -> None:
        """Offer θ and the momentum as they are to ``learning.pull``, as the state of
        ``round_`` (default: the round this member works on).  ``hashed``: they are the
        state whose hash this member published (not so between a fragment's outer step and
        its round's end)."""
        round_ = self.group.round if round_ is None else round_
        named = [(n, encode(t, "none")) for n, t in sorted(_joined(self.theta, self.outer.momentum).items())]
        self.group.offer("state", round_, named)
        self._offered = (self.version if hashed else -1, round_)

    def _shared_state(self) -> tuple:
        """The state a joining member takes over shard sync, as ``learning.state`` publishes it:
        (version, round, tensors by name, a function giving its hash).  The tensors are θ's and
        the momentum's own (no copy): the group steps copies while a publish reads them."""
        group = self.group
        theta, momentum = self.theta, self.outer.momentum
        tensors = _joined(theta, momentum)
        if self._offered[0] == self.version:
            round_ = self._offered[1]
            known = group.hash if group.hash_round == round_ - 1 else None
            if known is not None:
                return self.version, round_, tensors, lambda: known
        else:  # between a fragment's outer step and the round's end (Streaming DiLoCo)
            round_ = group.round
        return self.version, round_, tensors, lambda: state_hash(theta, momentum)

    async def _resync(self, peer: bytes) -> None:
        """Take θ, the outer momentum and the round from ``peer`` (unless a resync is under way),
        and contribute from that round on: over shard sync if this node runs the shards
        service and the state is ``shard_sync_min_bytes`` or more (and that works), else
        over ``learning.pull``: a publish's fixed cost (files, fsyncs, a manifest) is more
        than a small state's whole pull, and a member that takes longer to join falls
        behind a group whose rounds are short."""
        if self._resyncing is not None:  # one under way: its state, once applied, is the one to have
            await self._resyncing.wait()
            return
        self._resyncing = trio.Event()
        started = time.perf_counter()
        size = 2 * sum(t.numel() * 4 for t in self.theta.values())  # θ and momentum, fp32
        shards = self.group.states is not None and size >= self._service.config.shard_sync_min_bytes
        try:
            path, taken = "shards", await self._take_shards(peer) if shards else None
            if taken is None:
                path, taken = "pull", await self._take_pull(peer)
            if taken is not None:
                while self._writing is not None:  # a worker thread is writing Δ or θ: apply after it
                    await self._writing.wait()
                self._apply(peer, *taken, path=path, seconds=time.perf_counter() - started)
        finally:
            self._resyncing.set()
            self._resyncing = None

    async def _take_shards(self, peer: bytes) -> tuple[int, dict, bytes] | None:
        """``peer``'s round, state and its hash over shard sync, checked against the hash it says;
        None if that fails."""
        group = self.group
        try:
            round_, digest, tensors = await group.take_state(PeerId(peer), timeout=group.clock.timeout())
            theta, momentum = _split(tensors)
            if await trio.to_thread.run_sync(state_hash, theta, momentum) != digest:
                raise ValueError("the tensors do not match the hash it says")
        except Exception as exc:  # noqa: BLE001  (whatever failed, learning.pull is the way left)
            log.warning("%s: could not take the state of %s over shard sync (%s: %s); pulling it",
                        group.tag, PeerId(peer).short(), type(exc).__name__, exc)
            return None
        return round_, tensors, digest

    async def _take_pull(self, peer: bytes) -> tuple[int, dict, bytes] | None:
        """``peer``'s round, state and its hash (computed here, off the loop) over
        ``learning.pull``; None if that fails."""
        group = self.group
        try:
            contribution, named = await group.pull(PeerId(peer), "state", timeout=group.clock.timeout())
        except (RpcError, trio.TooSlowError, OSError) as exc:
            log.warning("%s: could not take the state of %s: %r", group.tag, PeerId(peer).short(), exc)
            return None
        tensors = {name: decode(enc) for name, enc in named}
        return contribution.round, tensors, await trio.to_thread.run_sync(state_hash, *_split(tensors))

    def _apply(self, peer: bytes, round_: int, tensors: dict, digest: bytes, *, path: str, seconds: float) -> None:
        """Make ``tensors`` (theta/NAME, momentum/NAME) of ``round_`` this member's state;
        ``digest`` is their :func:`state_hash` (computed off the loop by the caller).

        Taken while this member's own exchange of ``round_`` is under way (a hash check
        found its state off just as it reached the sync), the exchange is not moot: its
        parts are with the reducers, and its outcome is the step the state taken needs,
        so the sync goes on and lands it there.  A later round's state makes the sync
        under way moot: it returns at once and the training goes on from that state."""
        group = self.group
        theta, momentum = _split(tensors)
        if set(theta) != set(self.theta):
            log.warning("%s: %s trains another model (parameter names differ)", group.tag,
                        PeerId(peer).short())
            return
        if round_ <= group.hash_round:  # behind us
            if not self._solo:  # taking it would redo an exchange we took part in
                log.info("%s: not taking round %d's state from %s: this member has finished round %d",
                         group.tag, round_, PeerId(peer).short(), group.hash_round)
                return
            group.rewind(round_)  # we trained ahead alone: the group's rounds from round_ are to come
        self._solo = False
        self.resyncs += self.group.hash is not None
        self.takes[path] += 1
        self.taken_states.append({"path": path, "round": round_, "peer": peer, "seconds": seconds,
                                  "bytes": sum(t.numel() * t.element_size() for t in tensors.values())})
        self.theta = {n: t.float() for n, t in theta.items()}
        self.outer.momentum = {n: t.float() for n, t in momentum.items()}
        if self._syncing is not None and self._flat is not None:
            self._detach()
        else:
            self._reset_params(self._params)
        self._buffers.clear()  # exchanges under way keep theirs: the next ones start afresh
        self._residual.clear()  # (what the codec lost was of the state left behind)
        self.version += 1
        group.publish_hash(round_ - 1, digest)  # (said at once)
        self._offer_state(round_)  # this state's round, whatever this member's was
        _trim()  # the state left behind, freed now: back to the system before the next exchange peaks
        log.info("%s: took round %d's state from %s (%s, %.3f s)", group.tag, round_, PeerId(peer).short(),
                 path, seconds)
        if self._syncing is not None and round_ == self._sync_round:  # its outcome steps this state
            return
        self._taken += 1
        group.round = group.joined = round_  # off that round's roster, it follows the round
        self.steps = round_ * self.H
        if self._syncing is not None:  # the sync under way is moot here: the training goes on from this state
            self._syncing.set()

    # --- one exchange -------------------------------------------------------------------------------

    def _delta(self, p: int) -> torch.Tensor:
        """Fragment ``p``'s Δ = θ − θ_local, flattened in name order, written into
        the fragment's one flat vector: the parameters themselves where
        :func:`_flatten` made them one (θ_local is not needed once Δ is taken;
        the outer step writes θ back), else a vector kept from exchange to
        exchange (one exchange of a fragment ends before its next begins).
        With codec none the average is written back into it, so a large
        model's exchange maps no fresh memory of its size, page faults and all."""
        names = sorted(self.fragments[p])
        if self._flat is not None:
            with torch.no_grad():
                for n in names:
                    param = self._params[n].detach()
                    torch.sub(self.theta[n], param, out=param)
            return self._flat
        if p not in self._buffers:
            self._buffers[p] = torch.empty(sum(self.theta[n].numel() for n in names))
        out, at = self._buffers[p], 0
        for n in names:
            size = self.theta[n].numel()
            torch.sub(self.theta[n], _host(self._params[n]), out=out[at:at + size].view_as(self.theta[n]))
            at += size
        return out

    async def _begin(self, p: int) -> None:
        """Start fragment ``p``'s exchange in the background (Streaming DiLoCo), its Δ taken
        off the node's loop."""
        out: dict = {}
        done = trio.Event()
        samples, round_ = self.samples, self.steps // self.H - (self.steps % self.H == 0)
        taken = self._taken  # a state taken from here on is not to be stepped by this exchange
        delta = await self._in_thread(self._delta, p)

        async def run() -> None:
            try:
                out.update(await self._exchange(round_, p, delta, samples), taken=taken)
            finally:
                done.set()

        self._inflight[p] = (self.steps + self.overlap, done, out)
        self._service.spawn(run)

    async def _sync(self, p: int) -> None:
        """Exchange fragment ``p`` (P = 1) and land it; or return as soon as a state is taken
        from another member meanwhile, the exchange going on in the background: the
        others may still fetch the slice this member reduces (cancelling it split the
        group), and waiting it out kept the member from training, up to the round's
        deadline, in a state it had already left.  A member two rounds or more ahead
        meanwhile means the group left this round behind: its state is taken then."""
        round_ = self.steps // self.H - 1
        taken = self._taken
        ended = self._syncing = trio.Event()
        self._sync_round = round_
        result: dict = {}
        exchange = trio.CancelScope()

        async def run(delta: torch.Tensor, samples: int) -> None:
            try:
                with exchange:
                    result["out"] = {**await self._exchange(round_, p, delta, samples), "taken": taken}
            except Exception as exc:  # noqa: BLE001  (raised by the sync if it still waits, else logged)
                result["error"] = exc
                if self._taken != taken:
                    log.info("%s: round %d's exchange, moot here, failed: %r", self.group.tag, round_, exc)
            finally:
                ended.set()

        async def catch_up() -> None:  # the group left this round behind: take a later state (ends the wait)
            while True:  # a state of this very round (or none) leaves the wait on: ask again at the next hello
                await self._resync(await self.group.ahead_of(round_))
                await self.group.next_hello()

        try:
            delta = await self._in_thread(self._delta, p)
            self._service.spawn(run, delta, self.samples)
            async with trio.open_nursery() as waiting:
                waiting.start_soon(catch_up)
                await ended.wait()
                waiting.cancel_scope.cancel()
        except BaseException:
            exchange.cancel()  # it stops at its next checkpoint: till then it may write its vector
            if self._taken == taken and self._flat is not None:  # the parameters held Δ, or part of
                self._detach()                                       # the average: back to θ
            elif self._taken == taken:
                self._reset_params(self.fragments[p])
            self._buffers.pop(p, None)
            raise
        finally:
            self._syncing = self._sync_round = None
        if self._taken != taken:  # the parameters hold the state taken already
            return
        if "out" not in result:  # it failed, or was cancelled: the node closed under it
            if self._flat is not None:
                self._reset_params(self.fragments[p])
            raise result.get("error") or trio.ClosedResourceError(
                f"{self.group.tag}: the node closed during round {round_}'s exchange")
        await self._land(p, result["out"], streaming=False)

    async def _in_thread(self, work, *args):
        """``work(*args)`` in a worker thread (torch and blake3 let go of the GIL), so a
        large model's pass over θ does not stop the node's loop (hellos, peers' pulls and
        slices) for its length; a state taken meanwhile is applied after it.  A thread
        cannot be stopped, so a cancellation waits for it and for the caller's next
        checkpoint: what the caller does with the result is not cut in half."""
        self._writing = trio.Event()
        try:
            with trio.CancelScope(shield=True):
                return await trio.to_thread.run_sync(work, *args)
        finally:
            self._writing.set()
            self._writing = None

    def _detach(self) -> None:
        """Give the parameters a new vector holding θ (``in_place``): the exchange under way
        keeps the one they were (parts are lent from it, the average lands in it)."""
        names = sorted(self._params)
        self._flat = _rebind([self._params[n] for n in names], [self.theta[n] for n in names])

    def _reset_params(self, names) -> None:
        with torch.no_grad():
            for n in names:
                self._params[n].copy_(self.theta[n])

    async def _exchange(self, round_: int, p: int, delta: torch.Tensor, samples: int) -> dict:
        group = self.group
        started, before = time.perf_counter(), sum(group.bytes_out.values())
        lossy = self.compression != "none"
        residual = self._residual.get(p)  # error feedback: what the codec lost of the last exchange
        q = delta.add_(residual) if residual is not None else delta
        if lossy and residual is None:
            residual = self._residual[p] = torch.zeros_like(delta)
        rule = parse_rule(self.rule)

        def reduce(tensors, weights):
            result = aggregate(tensors, weights, rule)
            return result.value, result.clipped

        avg, missing, used = await group.allreduce(
            (round_, p), q, samples=samples, encode=lambda t: encode(t, self.compression, self.block),
            decode=decode, reduce=reduce, out=q, error=residual if lossy else None, stream=rule.name == "mean")
        gap = sum(hi - lo for lo, hi in missing)
        self._solo = set(used) <= {group.me}
        self.membership.report(role="contributor" if group.me in used else "follower")
        self.reports.append(SyncReport(round_, p, len(used), gap, sum(group.bytes_out.values()) - before,
                                       time.perf_counter() - started))
        return {"round": round_, "avg": avg}

    async def _land(self, p: int, out: dict, *, streaming: bool) -> None:
        """Apply the outer step for fragment ``p``, unless a state taken meanwhile replaced θ.

        The step, the copy into the parameters and the state's hash run in a worker
        thread; meanwhile the state offered to joining members is withheld (their
        pulls wait for the new one) and a state taken is applied after it."""
        group = self.group
        if out["taken"] != self._taken:  # the state taken is in the parameters already
            return
        names = sorted(self.fragments[p])
        offsets, at = {}, 0
        for n in names:
            offsets[n] = (at, at + self.theta[n].numel())
            at += self.theta[n].numel()
        avg = out["avg"]
        delta = {n: avg[lo:hi].view_as(self.theta[n]) for n, (lo, hi) in offsets.items()}
        if group.serving["state"]:  # a peer is taking our state: step copies of it, not what it reads
            self.theta = {n: t.clone() for n, t in self.theta.items()}
            self.outer.momentum = {n: t.clone() for n, t in self.outer.momentum.items()}
        ends_round = p == self.P - 1 or not streaming
        if ends_round:  # the group sees this member in the next round now, as when the step was not in a thread:
            self.samples = 0  # a roster fixed meanwhile has it on (its parts come early, and wait)
            group.round = out["round"] + 1
        group.withhold("state")
        digest = await self._in_thread(self._step, names, delta, streaming, ends_round)
        self.version += 1
        if ends_round:
            group.publish_hash(out["round"], digest)
            self._service.spawn(self._check_hash)
        self._offer_state(hashed=ends_round)

    def _step(self, names: list, delta: dict, streaming: bool, ends_round: bool) -> bytes | None:
        """The outer step of ``names`` (in place: no copy of a large model's state per round),
        θ into the parameters (mixed with them when streaming); the state's hash if the
        round ends.  Run in a worker thread (:meth:`_land`)."""
        self.outer.step(self.theta, delta)
        with torch.no_grad():
            for n in names:
                local = self._params[n]
                value = mix(_host(local), self.theta[n], self.alpha) if streaming else self.theta[n]
                local.copy_(value)
        _trim()
        return state_hash(self.theta, self.outer.momentum) if ends_round else None

    async def _check_hash(self) -> None:
        """Resync from a member with the majority's hash if ours differs; else from the
        group's source (:meth:`Group.source`) if it is two rounds or more ahead of us (we
        started alone, or were cut off a while), or if our last round was ours alone and
        its state is one others hold and we do not (we trained ahead alone: back to the
        group's round, whatever ours)."""
        group = self.group
        peer = await group.dissent(3 * self._service.config.heartbeat_interval)
        source, corroborated = group.source()
        if peer is None and source != group.me:
            if group.view.members[source].round > group.round + 1:
                peer = source
            elif self._solo and corroborated and not group.holds(source):
                log.info("%s: this member's rounds were its own alone: back to %s's state",
                         group.tag, PeerId(source).short())
                peer = source
        if peer is not None:
            await self._resync(peer)
