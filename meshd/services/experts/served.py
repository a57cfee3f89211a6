"""One expert this node serves: calls queued, batched, and run one batch at a time.

Calls whose inputs agree in everything but their first dimension (the rows)
are concatenated into one batch (:class:`experts.batching.Batcher`: when the
module is free, as many as fit in ``max_batch`` rows, once that many wait or
the oldest has waited ``max_wait`` seconds), run through the
module in a worker thread under ``torch.no_grad`` (so the node keeps
answering while the module computes), and the outputs are split back by
rows.  A queue past its limits refuses new calls (RESOURCE_EXHAUSTED: the
caller tries another server), a call whose caller left is skipped, and a
module that raises fails the calls of that batch with a clear error, never
the node.

What a call runs depends on the expert's kind:

* ``module``, ``flow``, ``router``: op ``forward``, ``module(*inputs)``;
* ``lm``: op ``score``, for ids ``[B, T]`` (int64) the log-probability of each
  next token ``[B, T-1]`` and the log-distribution after the last ``[B, V]``,
  so a client mixes experts without shipping whole distributions per position.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter
from dataclasses import dataclass, field

import trio

from experts.batching import Batcher

from ...rpc import DeadlineExceeded, InvalidArgument, ResourceExhausted, RpcError

log = logging.getLogger("meshd.experts")

KINDS = {"module": ("forward",), "flow": ("forward",), "router": ("forward",), "lm": ("score",)}


@dataclass
class _Call:
    op: str
    inputs: list
    peer: bytes
    done: trio.Event = field(default_factory=trio.Event)
    outputs: list | None = None
    error: Exception | None = None
    abandoned: bool = False
    rows_in_batch: int = 0


class Served:
    """Expert ``expert_id`` served by this node: ``await call(...)`` from the RPC
    handler, ``await run()`` in the service's background."""

    def __init__(self, expert_id: str, module, *, kind: str, info: dict, max_batch: int, max_wait: float,
                 max_queue: int, max_queue_per_peer: int):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
        self.expert_id, self.module, self.kind, self.info = expert_id, module, kind, info
        self.max_batch, self.max_wait = max_batch, max_wait
        self.max_queue, self.max_queue_per_peer = max_queue, max_queue_per_peer
        Batcher(max_batch, max_wait)  # a bad max_batch or max_wait fails here, not at the first call
        self._batchers: dict[tuple, Batcher] = {}  # per input signature
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count()
        self._wake = trio.Event()
        self._per_peer: Counter = Counter()
        self.calls = self.batches = self.rows = self.refused = self.failed = 0
        self.seconds = 0.0  # spent in the module

    def load(self) -> dict:
        """What this server tells callers about its load."""
        return {"queued": len(self._calls), "calls": self.calls, "batches": self.batches, "rows": self.rows,
                "refused": self.refused, "failed": self.failed,
                "ms_per_batch": 1000 * self.seconds / self.batches if self.batches else None}

    async def call(self, peer: bytes, op: str, inputs: list, *, timeout: float) -> tuple[list, int]:
        """Run ``inputs`` through the expert in some batch; its outputs for them and the batch's rows.

        InvalidArgument for an op this kind lacks or inputs whose first
        dimensions differ; ResourceExhausted when the queue is full."""
        if op not in KINDS[self.kind]:
            raise InvalidArgument(f"a {self.kind} expert answers {', '.join(KINDS[self.kind])}, not {op!r}")
        rows = {int(t.shape[0]) if t.dim() else -1 for t in inputs}
        if len(rows) != 1 or min(rows) < 1:
            raise InvalidArgument("every input has the same first dimension (its rows), at least 1")
        if len(self._calls) >= self.max_queue or self._per_peer[peer] >= self.max_queue_per_peer:
            self.refused += 1
            raise ResourceExhausted(f"expert {self.expert_id} is busy ({len(self._calls)} calls queued)")
        key, call = next(self._ids), _Call(op, inputs, peer)
        self._calls[key] = call
        self._per_peer[peer] += 1
        signature = (op, tuple((str(t.dtype), tuple(t.shape[1:])) for t in inputs))
        batcher = self._batchers.get(signature)
        if batcher is None:
            batcher = self._batchers[signature] = Batcher(self.max_batch, self.max_wait)
        batcher.add(key, rows.pop(), trio.current_time())
        self._wake.set()
        try:
            with trio.fail_after(timeout):
                await call.done.wait()
        except trio.TooSlowError:
            raise DeadlineExceeded(f"expert {self.expert_id} did not get to this call within {timeout:g} s") from None
        finally:
            if not call.done.is_set():
                call.abandoned = True  # the batch that holds it skips it
                self._forget(key)
        if call.error is not None:
            raise call.error
        return call.outputs, call.rows_in_batch

    def _forget(self, key: int) -> None:
        call = self._calls.pop(key, None)
        if call is not None:
            self._per_peer[call.peer] -= 1
            if self._per_peer[call.peer] <= 0:
                del self._per_peer[call.peer]

    async def run(self) -> None:
        """Run batches as they fill or fall due, one at a time (the oldest call's first), until cancelled."""
        while True:
            now = trio.current_time()
            for signature in [s for s, b in self._batchers.items() if not b.pending]:
                del self._batchers[signature]  # a batcher per input shape that waits: bounded by the queue
            ready = [b for b in self._batchers.values() if b.ready(now)]
            if ready:
                await self._run(min(ready, key=lambda b: b.oldest()).take(now))
                continue
            deadlines = [d for d in (b.deadline() for b in self._batchers.values()) if d is not None]
            with trio.move_on_at(min(deadlines, default=math.inf)):
                await self._wake.wait()
            self._wake = trio.Event()

    async def _run(self, keys: list[int]) -> None:
        import torch  # noqa: PLC0415

        calls = [self._calls[k] for k in keys if k in self._calls and not self._calls[k].abandoned]
        if not calls:
            return
        counts = [int(c.inputs[0].shape[0]) for c in calls]
        inputs = [torch.cat([c.inputs[i] for c in calls]) for i in range(len(calls[0].inputs))]
        started = trio.current_time()
        try:
            outputs = await trio.to_thread.run_sync(self._forward, calls[0].op, inputs)
            total = sum(counts)
            if not outputs or any(o.dim() == 0 or o.shape[0] != total for o in outputs):
                raise ValueError(f"every output of the module has the batch's {total} rows first")
        except Exception as exc:  # the module's trouble: the callers hear it, the node goes on
            log.warning("expert %s failed a batch of %d: %r", self.expert_id, len(calls), exc)
            self.failed += len(calls)
            error = exc if isinstance(exc, RpcError) else RpcError(f"expert {self.expert_id} failed: {exc!r:.200}")
            for call in calls:
                call.error = error
        else:
            parts = [o.split(counts) for o in outputs]
            for i, call in enumerate(calls):
                call.outputs = [p[i].contiguous() for p in parts]
            self.calls += len(calls)
            self.rows += sum(counts)
        self.batches += 1
        self.seconds += trio.current_time() - started
        for call in calls:
            call.rows_in_batch = sum(counts)
            call.done.set()
        for key in keys:
            self._forget(key)

    def _forward(self, op: str, inputs: list) -> list:
        import torch  # noqa: PLC0415

        with torch.no_grad():
            if op == "score":
                ids = inputs[0]
                if ids.dtype != torch.int64 or ids.dim() != 2 or ids.shape[1] < 2:
                    raise InvalidArgument("score takes token ids, int64 [batch, length >= 2]")
                logp = torch.log_softmax(self.module(ids).float(), dim=-1)
                scored = logp[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
                return [scored, logp[:, -1]]
            result = self.module(*inputs)
        return list(result) if isinstance(result, (tuple, list)) else [result]
