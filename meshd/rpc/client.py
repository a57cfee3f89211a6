"""Making calls: unary, server-streaming and client-streaming.

Each function takes ``open_stream``, an async callable returning a fresh
CallStream to the server, so the same code calls peers over QUIC and the
local daemon over its Unix socket.

Deadlines: ``timeout`` bounds the call locally (DeadlineExceeded when it runs
out), and the time left, also bounded by any enclosing trio deadline, travels
with the request so the server stops working when the caller stops waiting.
"""

from __future__ import annotations

import math
from contextlib import asynccontextmanager
from typing import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable

import trio

from ..streams import CallStream, StreamAborted
from ..wire import FrameError
from . import protocol as P
from .errors import DeadlineExceeded, ProtocolViolation, Unavailable
from .channel import Channel
from .framed import Framed, call_error

OpenStream = Callable[[], Awaitable[CallStream]]


def _deadline(timeout: float | None) -> float:
    return math.inf if timeout is None else trio.current_time() + timeout


def _wire_timeout(deadline: float) -> float | None:
    """Seconds the server may spend: our deadline or an enclosing one, whichever is first."""
    effective = min(deadline, trio.current_effective_deadline())
    return None if effective == math.inf else max(0.0, effective - trio.current_time())


async def _read_reply(framed: Framed) -> object:
    kind, value = await framed.read_answer("peer ended the call without a reply")
    if kind == P.REPLY:
        return value
    raise ProtocolViolation(f"expected a reply, got frame type {kind}")


async def unary_call(
    open_stream: OpenStream, method: str, arg: object, timeout: float | None, max_frame: int
) -> object:
    """Send one request, return the one reply (or raise the typed RpcError).

    A call the peer never saw (its connection was replaced first) is sent
    once more, on whatever connection ``open_stream`` gives next.
    """
    deadline = _deadline(timeout)
    with trio.move_on_at(deadline):
        for again in (True, False):
            try:
                return await _unary_once(open_stream, method, arg, deadline, max_frame)
            except Unavailable as exc:
                if not (again and exc.unprocessed):
                    raise
    raise DeadlineExceeded(f"{method} did not answer within {timeout} s")


async def _unary_once(
    open_stream: OpenStream, method: str, arg: object, deadline: float, max_frame: int
) -> object:
    async def send(framed: Framed) -> None:
        await framed.write(P.request_frame(method, _wire_timeout(deadline), P.UNARY, arg), eof=True)

    return await _call(await open_stream(), max_frame, send)


async def _call(stream: CallStream, max_frame: int, send: Callable[[Framed], Awaitable[None]]) -> object:
    """Run ``send`` on ``stream``, then read the one reply and close; any failure resets the stream."""
    framed = Framed(stream, max_frame)
    try:
        await send(framed)
        result = await _read_reply(framed)
    except (StreamAborted, FrameError) as exc:
        stream.abort()
        raise call_error(exc) from None
    except BaseException:
        stream.abort()
        raise
    await stream.close()
    return result


async def client_stream_call(
    open_stream: OpenStream,
    method: str,
    items: AsyncIterable | Iterable,
    timeout: float | None,
    max_frame: int,
) -> object:
    """Stream ``items`` to the server, then return its one reply.

    If the server fails the call early (unknown method, bad item), sending
    stops and its error is raised.
    """
    deadline = _deadline(timeout)

    async def send(framed: Framed) -> None:
        try:
            await framed.write(P.request_frame(method, _wire_timeout(deadline), P.CLIENT_STREAM, None))
            if isinstance(items, AsyncIterable):
                async for item in items:
                    await framed.write([P.ITEM, item])
            else:
                for item in items:
                    await framed.write([P.ITEM, item])
            await framed.write(P.END_FRAME, eof=True)
        except StreamAborted:
            pass  # the server stopped reading: its reply says why

    with trio.move_on_at(deadline):
        return await _call(await open_stream(), max_frame, send)
    raise DeadlineExceeded(f"{method} did not answer within {timeout} s")


class ResponseStream:
    """The items of a server-streaming call, as an async iterator.

    Use ``async for item in rpc.stream(...)``; breaking out early or leaving an
    ``async with`` block resets the stream, which cancels the server's handler.
    """

    def __init__(
        self, open_stream: OpenStream, method: str, arg: object, timeout: float | None, max_frame: int
    ):
        self._open_stream = open_stream
        self._method = method
        self._arg = arg
        self._timeout = timeout
        self._deadline = _deadline(timeout)
        self._max_frame = max_frame
        self._framed: Framed | None = None
        self._done = False
        self._resent = False

    def __aiter__(self) -> "ResponseStream":
        return self

    async def __aenter__(self) -> "ResponseStream":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def __anext__(self) -> object:
        if self._done:
            raise StopAsyncIteration
        try:
            with trio.move_on_at(self._deadline):
                return await self._next()
        except BaseException:
            await self.aclose()
            raise
        await self.aclose()
        raise DeadlineExceeded(f"{self._method} did not finish within {self._timeout} s")

    async def _next(self) -> object:
        try:
            return await self._next_once()
        except Unavailable as exc:
            if not exc.unprocessed or self._resent:
                raise
        self._resent = True  # the peer never saw the request: nothing came of it yet
        self._framed = None
        return await self._next_once()

    async def _next_once(self) -> object:
        try:
            if self._framed is None:
                stream = await self._open_stream()
                self._framed = Framed(stream, self._max_frame)
                wire_timeout = _wire_timeout(self._deadline)
                await self._framed.write(
                    P.request_frame(self._method, wire_timeout, P.SERVER_STREAM, self._arg),
                    eof=True,
                )
        except (StreamAborted, FrameError) as exc:
            raise call_error(exc) from None
        kind, value = await self._framed.read_answer("peer ended the stream without END")
        if kind == P.ITEM:
            return value
        if kind == P.END:
            self._done = True
            await self._framed.stream.close()
            raise StopAsyncIteration
        raise ProtocolViolation(f"expected an item, got frame type {kind}")

    async def aclose(self) -> None:
        """Stop the call; the server's handler is cancelled if still running."""
        if not self._done:
            self._done = True
            if self._framed is not None:
                self._framed.stream.abort()

    def __del__(self) -> None:
        if not self._done and self._framed is not None:
            self._framed.stream.abort()


@asynccontextmanager
async def bidi_call(
    open_stream: OpenStream, method: str, arg: object, timeout: float | None, max_frame: int
) -> AsyncIterator[Channel]:
    """Start a bidi call and yield its Channel; leaving the block ends or aborts it.

    A normal exit ends our direction (if not done yet) and stops reading; an
    exception aborts the stream, which cancels the server's handler.
    ``timeout`` bounds the whole call.
    """
    deadline = _deadline(timeout)
    with trio.move_on_at(deadline) as scope:
        stream = await open_stream()
        framed = Framed(stream, max_frame)
        try:
            await framed.write(P.request_frame(method, _wire_timeout(deadline), P.BIDI, arg))
            channel = Channel(framed, caller=True)
            yield channel
            await channel.end()
        except BaseException:
            stream.abort()
            raise
        await stream.close()
    if scope.cancelled_caught:
        raise DeadlineExceeded(f"{method} did not finish within {timeout} s")
