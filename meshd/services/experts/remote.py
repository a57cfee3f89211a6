"""A remote expert that behaves like a module call: chosen server, hedged, retried.

:class:`RemoteExpert` looks up the peers serving an expert (the DHT, again
every ``refresh_interval``), orders them by measured latency
(:class:`experts.servers.Servers`: EWMA per server; one that failed is not
asked again until its back-off ends, so a dead expert costs an ensemble one
failed call, not one per request), and calls the first.  If it has not answered within the hedge delay (1.5×
the 95th percentile of recent calls) the next one is asked too, and the
first answer wins; a server that fails is dropped from this call and the
next is asked at once.  Every answer and failure is measured, so the next
call starts from the fastest server.  It raises :class:`ExpertUnavailable`
(saying what each server did) when none answered.

Concurrent calls to one :class:`RemoteExpert` are coalesced
(:class:`experts.coalescing.Coalescer`): calls whose inputs agree in all but
their rows leave together as one request, up to the servers' ``max_batch``
rows and :data:`COALESCE_BYTES` of inputs.  Those made at one moment (by
callers woken together) leave together at once; while
:data:`COALESCE_DEPTH` requests of the expert are in flight, later calls
wait for one to come back, unless they fill a request.  So a lone call is
not held back, and calls wait only while the server has work of this
caller's anyway.  A request is asked, hedged and retried as one call; each
caller gets its own rows of the answer, or the request's error, and a
request no caller waits for any more is cancelled.  The server batches
requests as it batched calls; what coalescing saves is the CPU each request
costs both sides.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field

import torch
import trio

from experts.coalescing import Coalescer
from experts.servers import Servers

from ...identity import PeerId
from ...rpc import RpcError
from .service import Experts, check_expert_id

log = logging.getLogger("meshd.experts")

FIND_WAIT = 5.0  # seconds a caller keeps looking for an expert nobody is known to serve
COALESCE_DEPTH = 2  # requests of one RemoteExpert in flight before its calls wait to be coalesced (two: the
#                    server has the next one queued while it runs one)
COALESCE_BYTES = 4 << 20  # the most bytes of inputs a coalesced request carries (an RPC frame holds 16 MiB)


class ExpertUnavailable(Exception):
    """No server of the expert answered (each one's failure is in the message)."""


@dataclass
class Answer:
    """One call's outcome: the outputs, who answered, after how long, how many servers were asked."""

    outputs: list
    peer: PeerId
    seconds: float
    asked: int
    batch: int  # the rows of the server's batch that held it


@dataclass(eq=False)
class _Waiting:
    """A call waiting to be coalesced, or in a request: its inputs, and what it gets back."""

    inputs: tuple
    rows: int
    started: float
    done: trio.Event = field(default_factory=trio.Event)
    answer: Answer | None = None
    error: Exception | None = None
    request: _Request | None = None  # once it has left
    left: bool = False  # its caller stopped waiting


@dataclass(eq=False)
class _Request:
    """Calls that left together, and the scope that cancels their request once none waits."""

    calls: list[_Waiting]
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


class RemoteExpert:
    """Expert ``expert_id`` as the mesh serves it: ``await expert(*tensors)``.
    ``coalesce=False`` sends every call as a request of its own."""

    def __init__(self, node, expert_id: str, *, op: str = "forward", timeout: float | None = None,
                 hedge: bool = True, coalesce: bool = True):
        self._service: Experts = node.service("experts")
        self.expert_id = check_expert_id(expert_id)
        self.op, self.hedge, self.coalesce = op, hedge, coalesce
        self.timeout = self._service.config.call_timeout if timeout is None else timeout
        self.stats = Servers()
        self._servers: list[PeerId] = []
        self._found_at = -math.inf
        self._lookup = trio.Lock()  # concurrent calls share one lookup
        self._coalescer = Coalescer(COALESCE_DEPTH)
        self._waiting: dict[int, _Waiting] = {}  # by key in the coalescer
        self._keys = itertools.count()
        self._send_scheduled = False

    async def servers(self) -> list[PeerId]:
        """The peers serving the expert, looked up again every ``refresh_interval``
        (or when none are known).  A lookup that finds nobody is repeated, with
        a growing pause, for up to :data:`FIND_WAIT` seconds (or the call
        timeout): an expert announced a moment ago may not be in the DHT yet."""
        if self._fresh():  # no lock to take: concurrent calls ask for every call
            return self._servers
        async with self._lookup:
            if self._fresh():  # another call looked meanwhile
                return self._servers
            pause, deadline = 0.05, trio.current_time() + min(FIND_WAIT, self.timeout)
            while True:
                self._servers = await self._service.servers(self.expert_id)
                if self._servers or trio.current_time() + pause > deadline:
                    break
                await trio.sleep(pause)
                pause *= 2
            self._found_at = trio.current_time()
            return self._servers

    def served_here(self) -> bool:
        """Whether this node serves the expert itself (its calls are answered in-process)."""
        return self.expert_id in self._service.served

    def _fresh(self) -> bool:
        """Whether the servers known were found within ``refresh_interval``."""
        return bool(self._servers) and trio.current_time() - self._found_at <= self._service.config.refresh_interval

    async def __call__(self, *inputs):
        """The expert's output for ``inputs`` (a tensor, or a list if it gives several)."""
        outputs = (await self.call(*inputs)).outputs
        return outputs[0] if len(outputs) == 1 else outputs

    async def call(self, *inputs, op: str | None = None) -> Answer:
        """The answer of one of the servers for ``inputs`` (op ``op``, default the expert's):
        asked in order of measured latency, hedged and retried, in a request of its own or
        coalesced with concurrent calls (see the module), within ``timeout`` seconds after
        the servers are known.  ExpertUnavailable when none answered."""
        op = op or self.op
        rows = _rows(inputs)
        if not self.coalesce or rows is None:  # inputs the server will refuse go as they are, alone
            return await self._ask(list(inputs), op)
        await self.servers()  # the lookup (shared; cached) before the timeout starts
        key, call = next(self._keys), _Waiting(inputs, rows, trio.current_time())
        signature = (op, tuple((t.dtype, t.device, tuple(t.shape[1:])) for t in inputs))
        self._coalescer.add(key, signature, rows, self._limit(inputs, rows), call.started)
        self._waiting[key] = call
        self._send_soon()
        try:
            with trio.move_on_after(self.timeout) as waited:
                await call.done.wait()
        finally:
            if not call.done.is_set() and self._leave(key, call):
                with trio.CancelScope(shield=True):  # as a nursery would, let the request end first
                    await call.done.wait()  # (its server's failure counted), at its next checkpoint
        # Out of time with no answer, the caller hears so, even when the request's own deadline
        # (as long, started a moment later) ended it first in the same wake-up of a loaded process.
        if call.left or (waited.cancelled_caught and call.answer is None):
            raise ExpertUnavailable(f"expert {self.expert_id!r}: no answer within {self.timeout} s")
        if call.error is not None:
            raise call.error
        return call.answer

    def _limit(self, inputs: tuple, rows: int) -> int:
        """The most rows one request of calls like ``inputs`` (of ``rows`` rows) may carry:
        the servers' ``max_batch`` (1 until an answer named it: a server runs a larger
        request as a batch alone) and :data:`COALESCE_BYTES`."""
        row_bytes = sum(t.numel() * t.element_size() for t in inputs) // rows
        max_batch = self._service.max_batch(self.expert_id) or 1
        return max(1, min(max_batch, COALESCE_BYTES // max(1, row_bytes)))

    def _leave(self, key: int, call: _Waiting) -> bool:
        """``call``'s caller stopped waiting: it is dropped from its request, and a request
        no caller waits for any more is cancelled (then True)."""
        call.left = True
        self._waiting.pop(key, None)
        if call.request is None or not all(c.left for c in call.request.calls):
            return False
        call.request.scope.cancel()
        return True

    def _send_soon(self) -> None:
        """Have the requests due sent once the tasks that can run now have run, so that
        calls made at one moment (by callers woken together) leave together."""
        if not self._send_scheduled:
            self._send_scheduled = True
            self._service.host.spawn(self._send_due)

    async def _send_due(self) -> None:
        """Send every request the coalescer says is due, each in a task of the node."""
        self._send_scheduled = False
        while requests := self._coalescer.take(trio.current_time()):
            for (op, _), keys in requests:
                calls = [c for c in map(self._waiting.pop, keys, itertools.repeat(None)) if c is not None]
                if not calls:  # every caller left while waiting
                    self._coalescer.done()
                    continue
                request = _Request(calls)
                for call in calls:
                    call.request = request
                self._service.host.spawn(self._send, op, request)

    async def _send(self, op: str, request: _Request) -> None:
        """Ask for ``request``'s calls in one call and give each caller its rows of the answer,
        or the error; never raises (it runs in the node's nursery)."""
        calls = request.calls
        try:
            with request.scope:
                if len(calls) == 1:
                    inputs = list(calls[0].inputs)
                else:
                    inputs = [torch.cat(parts) for parts in zip(*(c.inputs for c in calls))]
                answer = await self._ask(inputs, op)
                parts = [o.split([c.rows for c in calls]) for o in answer.outputs]
                for i, call in enumerate(calls):
                    call.answer = Answer([p[i] for p in parts], answer.peer, trio.current_time() - call.started,
                                         answer.asked, answer.batch)
        except Exception as exc:  # noqa: BLE001  (ExpertUnavailable, or anything else: every caller hears it)
            for call in calls:
                call.error = exc
        finally:
            for call in calls:
                if call.answer is None and call.error is None:  # cancelled: the node stops
                    call.error = ExpertUnavailable(f"expert {self.expert_id!r}: the call was cut off")
                call.done.set()
            self._coalescer.done()
            self._send_soon()

    async def _ask(self, inputs: list, op: str) -> Answer:
        """Ask the servers for ``inputs`` in one call, in order of measured latency, hedged
        and retried (see the module)."""
        servers = await self.servers()
        now = trio.current_time()
        order = [s for s in self.stats.order(servers, now) if not self.stats.backing_off(s, now)]
        if not order:  # none, or each failed just now: do not wait on them again until the back-off ends
            why = "every server failed lately" if servers else "nobody serves it"
            raise ExpertUnavailable(f"expert {self.expert_id!r}: {why}")
        failures: dict[PeerId, str] = {}
        won: list[Answer] = []
        next_server = trio.Event()  # set: ask the next server now (one failed, or the hedge delay passed)

        async def attempt(peer: PeerId, asked: int, cancel: trio.CancelScope) -> None:
            started, ended = trio.current_time(), False
            try:
                outputs, batch = await self._service.call(peer, self.expert_id, op, inputs, timeout=self.timeout)
                ended = True
            except (RpcError, trio.TooSlowError, OSError) as exc:
                ended = True
                self.stats.observe(peer, trio.current_time() - started, False, trio.current_time())
                failures[peer] = str(exc) or type(exc).__name__
                next_server.set()
                return
            finally:
                if not ended and not won:  # cut off with no answer (the deadline, or the caller gave up):
                    self.stats.observe(peer, trio.current_time() - started, False, trio.current_time())  # failed
            seconds = trio.current_time() - started
            self.stats.observe(peer, seconds, True, trio.current_time())
            if not won:
                won.append(Answer(outputs, peer, seconds, asked, batch))
                cancel.cancel()

        with trio.move_on_after(self.timeout):
            async with trio.open_nursery() as nursery:
                for asked, peer in enumerate(order, start=1):
                    next_server = trio.Event()
                    nursery.start_soon(attempt, peer, asked, nursery.cancel_scope)
                    with trio.move_on_after(self.stats.hedge_delay() if self.hedge else math.inf):
                        await next_server.wait()
                    if won:
                        break
        if won:
            return won[0]
        self._servers = []  # they all failed: look again next time
        detail = "; ".join(f"{p.short()}: {why}" for p, why in failures.items()) or f"none within {self.timeout} s"
        raise ExpertUnavailable(f"expert {self.expert_id!r}: no server answered ({detail})")


def _rows(inputs: tuple) -> int | None:
    """The rows of ``inputs``: the first dimension they share (at least 1), else None."""
    rows = {int(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() else 0 for t in inputs}
    return rows.pop() if len(rows) == 1 and min(rows) > 0 else None
