"""Serving calls: a registry of handlers and the code that runs one call.

Handlers take ``(arg, ctx)``:

* unary: ``async def h(arg, ctx) -> result``
* server streaming: ``async def h(arg, ctx): yield item`` (an async generator)
* client streaming: ``async def h(items, ctx) -> result``, registered with
  ``kind="client_stream"``; ``items`` is an async iterator of the caller's messages.
* bidirectional: ``async def h(channel, ctx)``, registered with ``kind="bidi"``;
  see :mod:`meshd.rpc.channel`.

A handler rejects bad input by raising :class:`InvalidArgument` (or another
RpcError); every other exception is reported to the caller as INTERNAL.

Once the node is busy, a call may first wait for its turn (:class:`FairShare`:
a peer then runs at most its share, and the peer with fewest calls in flight
goes first), before its request is read, so QUIC flow control holds the
peer's bytes back meanwhile.  The bytes calls hold (requests, answers not yet
sent) are bounded per peer and node-wide (:class:`ByteBudget`): a frame past
either is answered RESOURCE_EXHAUSTED, its body unread.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import trio

from ..streams import CallStream, StreamAborted
from ..wire import FrameError, FrameTooLarge
from . import protocol as P
from .errors import (
    DeadlineExceeded,
    FrameTooLargeError,
    Internal,
    InvalidArgument,
    ProtocolViolation,
    ResourceExhausted,
    RpcError,
    UnknownMethod,
)
from .budget import ByteBudget, CallBytes
from .channel import Channel
from .fair import FairShare
from .framed import Framed
from .stats import OK, CallTable, CountingStream, outcome

log = logging.getLogger("meshd.rpc")

_KIND_BY_NAME = {name: kind for kind, name in P.KIND_NAMES.items()}


@dataclass
class CallContext:
    """What a handler knows about the call it serves."""

    peer: Any  # PeerId of the caller, or None on the control socket
    method: str
    deadline: float  # trio clock; inf when the caller set no timeout
    info: dict = field(default_factory=dict)  # transport facts: observed address, path


@dataclass(frozen=True)
class _Method:
    handler: Callable
    kind: int


class RpcServer:
    """Method registry plus the serving loop for one incoming call stream."""

    def __init__(
        self,
        *,
        max_frame: int,
        max_calls_per_peer: int = 256,
        first_frame_timeout: float = 10.0,
        max_call_timeout: float = 3600.0,
        explain_unknown: Callable[[str], RpcError | None] | None = None,
        busy_calls: float = math.inf,
        peer_share: int = 1,
        held_bytes: float = math.inf,
        peer_held_bytes: float = math.inf,
        address_held_bytes: float = math.inf,
    ):
        """``explain_unknown(name)`` may give the error for a method not
        registered (say, of a service that is off); UNKNOWN_METHOD otherwise.

        From ``busy_calls`` calls running in all, a peer that runs
        ``peer_share`` or more waits its turn (:class:`FairShare`); by default
        no call waits.  The frames calls hold may add up to ``held_bytes`` in
        all, ``peer_held_bytes`` per peer and ``address_held_bytes`` per address
        (a call's ``info["address"]``, where the caller gives one) (:class:`ByteBudget`);
        by default they are not bounded.
        """
        self.max_frame = max_frame
        self.max_calls_per_peer = max_calls_per_peer
        self.first_frame_timeout = first_frame_timeout
        self.max_call_timeout = max_call_timeout
        self._explain_unknown = explain_unknown
        self._methods: dict[str, _Method] = {}
        self._turns: FairShare[trio.Event] = FairShare(busy_calls, peer_share)
        self.budget = ByteBudget(held_bytes, peer_held_bytes, address_share=address_held_bytes)
        self.observer: CallTable | None = None  # counts each call that reached its handler, once set

    def register(self, name: str, handler: Callable, *, kind: str | None = None) -> None:
        """Serve ``name`` with ``handler``; the kind is inferred unless given.

        An async generator function is server streaming, a coroutine function
        unary; client streaming must be asked for.  Re-registering replaces.
        """
        if not 0 < len(name) <= P.MAX_METHOD_LEN:
            raise ValueError(f"method names are 1-{P.MAX_METHOD_LEN} characters")
        if kind is None:
            kind = "server_stream" if inspect.isasyncgenfunction(handler) else "unary"
        if kind not in _KIND_BY_NAME:
            raise ValueError(f"kind must be one of {sorted(_KIND_BY_NAME)}")
        self._methods[name] = _Method(handler, _KIND_BY_NAME[kind])

    def unregister(self, name: str) -> None:
        self._methods.pop(name, None)

    @property
    def methods(self) -> list[str]:
        return sorted(self._methods)

    @property
    def calls_waiting(self) -> int:
        """Calls waiting for their turn."""
        return self._turns.waiting

    async def serve_call(self, stream: CallStream, peer: Any, info: dict | None = None) -> None:
        """Run the call that arrives on ``stream`` to completion, once it is its turn.

        Never raises for anything the peer did: bad frames, unknown methods,
        over-limit calls, deadlines and handler failures become ERROR replies;
        a peer that resets or drops the stream cancels the handler, or the
        wait for its turn.
        """
        if not await self._turn(stream, peer):
            return
        held = CallBytes(self.budget, peer, (info or {}).get("address"))
        try:
            observer = self.observer
            if observer is not None:
                stream = CountingStream(stream)
            framed = Framed(stream, self.max_frame, held)
            try:
                await self._serve(framed, peer, info or {}, observer)
            except StreamAborted:
                stream.abort()
            except RpcError as exc:
                await self._send_error(framed, exc)
            except FrameTooLarge as exc:
                await self._send_error(framed, FrameTooLargeError(str(exc)))
            except FrameError as exc:
                await self._send_error(framed, ProtocolViolation(str(exc)))
        finally:
            held.end()
            self._end(peer)

    async def _turn(self, stream: CallStream, peer: Any) -> bool:
        """Wait until a call of ``peer`` may start, and count it as running: True.

        False (the stream aborted, nothing counted) if the peer abandoned the
        stream first.
        """
        turns = self._turns
        if turns.try_start(peer):
            return True
        turn = trio.Event()
        turns.wait(peer, turn)
        with trio.CancelScope() as abandoned:
            stream.cancel_on_abort(abandoned)
            try:
                await turn.wait()
            except BaseException:
                if turn.is_set():  # its turn came as it was cancelled
                    self._end(peer)
                else:
                    turns.leave(peer, turn)
                raise
            finally:
                stream.cancel_on_abort(None)
        if abandoned.cancelled_caught:
            stream.abort()
            return False
        return True

    def _end(self, peer: Any) -> None:
        """A call of ``peer`` is over: start the waiting calls whose turn it is."""
        for turn in self._turns.end(peer):
            turn.set()

    async def _send_error(self, framed: Framed, exc: RpcError) -> None:
        try:
            await framed.write([P.ERROR, exc.code, exc.message], eof=True)
            await framed.stream.close()
        except (StreamAborted, FrameError):
            framed.stream.abort()

    async def _serve(self, framed: Framed, peer: Any, info: dict, observer: CallTable | None) -> None:
        # One cancel scope serves the whole call: its deadline is first the wait
        # for the request, then the caller's deadline; a peer abort cancels it.
        ctx = None
        with trio.CancelScope(deadline=trio.current_time() + self.first_frame_timeout) as scope:
            ok, frame = await framed.read()
            if not ok:
                framed.stream.abort()
                return
            request = P.parse_request(frame)
            method = self._methods.get(request.method)
            if method is None:
                explained = self._explain_unknown and self._explain_unknown(request.method)
                raise explained or UnknownMethod(f"no method {request.method!r}")
            if method.kind != request.kind:
                raise InvalidArgument(
                    f"{request.method!r} is {P.KIND_NAMES[method.kind]}, "
                    f"called as {P.KIND_NAMES[request.kind]}"
                )
            if self._turns.running(peer) > self.max_calls_per_peer:  # this call included
                raise ResourceExhausted(
                    f"more than {self.max_calls_per_peer} concurrent calls from this peer"
                )
            timeout = self.max_call_timeout
            if request.timeout is not None:
                timeout = min(timeout, request.timeout)
            started = trio.current_time()
            ctx = CallContext(peer, request.method, started + timeout, info)
            scope.deadline = ctx.deadline
            try:
                await self._run(framed, method, request, ctx, scope)
            except BaseException as exc:
                if observer is not None:
                    _observe(observer, framed, ctx, started, exc)
                raise
            else:
                if observer is not None:
                    _observe(observer, framed, ctx, started, None)
        if scope.cancelled_caught:
            if ctx is None:
                raise ProtocolViolation("no request within the first-frame timeout")
            if trio.current_time() < ctx.deadline:  # cancelled early: the caller went away
                framed.stream.abort()
            else:
                raise DeadlineExceeded(f"{ctx.method} did not finish before its deadline")

    async def _run(self, framed: Framed, method: _Method, request: P.Request, ctx: CallContext,
                   scope: trio.CancelScope) -> None:
        stream = framed.stream
        try:
            if method.kind == P.CLIENT_STREAM:
                result = await method.handler(_incoming_items(framed, scope), ctx)
                stream.cancel_on_abort(scope)
                await framed.write([P.REPLY, result], eof=True)
            elif method.kind == P.BIDI:
                stream.cancel_on_abort(scope)
                channel = Channel(framed, caller=False, arg=request.arg)
                await method.handler(channel, ctx)
                await channel.end()
            else:
                stream.cancel_on_abort(scope)
                if method.kind == P.UNARY:
                    await framed.write([P.REPLY, await method.handler(request.arg, ctx)], eof=True)
                else:
                    await self._stream_items(framed, method.handler(request.arg, ctx))
            stream.cancel_on_abort(None)
            await stream.close()
        except (RpcError, FrameError, StreamAborted):
            raise
        except Exception as exc:  # a handler bug must not take the node down
            log.warning("handler %s failed: %r", ctx.method, exc, exc_info=True)
            raise Internal(f"handler failed: {type(exc).__name__}") from None
        finally:
            stream.cancel_on_abort(None)

    async def _stream_items(self, framed: Framed, items: AsyncIterator) -> None:
        try:
            async for item in items:
                await framed.write([P.ITEM, item])
        finally:
            aclose = getattr(items, "aclose", None)
            if aclose is not None:
                await aclose()
        await framed.write(P.END_FRAME, eof=True)


def _observe(table: CallTable, framed: Framed, ctx: CallContext, started: float,
             exc: BaseException | None) -> None:
    """Count a call that reached its handler: how long it ran, how it ended, its bytes."""
    now = trio.current_time()
    if exc is None:
        code = OK
    elif isinstance(exc, trio.Cancelled) and now >= ctx.deadline:
        code = DeadlineExceeded.code
    else:
        code = outcome(exc)
    stream: CountingStream = framed.stream  # type: ignore[assignment]
    table.add(ctx.method, now - started, code, stream.received, stream.sent)


async def _incoming_items(framed: Framed, aborted: trio.CancelScope) -> AsyncIterator:
    """The caller's ITEM frames until END; an early end of stream aborts the call."""
    while True:
        ok, frame = await framed.read()
        if not ok:
            aborted.cancel()
            await trio.lowlevel.checkpoint()
        framed.let_go()  # an item is held while it arrives; the handler keeps what it keeps
        kind, value = P.parse_frame(frame)
        if kind == P.END:
            return
        if kind != P.ITEM:
            raise ProtocolViolation("a client stream carries ITEM frames and one END")
        yield value
