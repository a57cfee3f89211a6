"""The client for callers with no event loop (``meshctl``): :class:`meshd.Client`'s
methods over a blocking Unix socket.

Importing trio takes longer than a whole ``meshctl`` command may (about 110 ms
of its 150 ms on two cores, docs/performance.md), so the CLI does without it.
The methods stay the coroutines :mod:`meshd.client` defines, but here every
``await`` completes at once, because the socket calls under them block
rather than suspend; :func:`run` drives such a coroutine to its end with no
event loop.  The bytes on the socket are written and read by the code the
async client uses (:class:`~meshd.rpc.framed.Framed`, :mod:`meshd.rpc.protocol`,
the errors of :mod:`meshd.rpc.errors`); only the deadlines differ: a socket
timeout here, a trio cancel scope there.

::

    client = BlockingClient(socket_path("~/.meshd"))
    print(run(client.status))
"""

from __future__ import annotations

import socket
import time
from typing import Any, Awaitable, Callable, TypeVar

from ..control.mux import Mux, MuxError
from ..control.socket import MAX_FRAME
from ..rpc import protocol as P
from ..rpc.errors import DeadlineExceeded, ProtocolViolation
from ..rpc.framed import Framed, call_error
from ..streams import StreamAborted
from ..wire import FrameError
from . import Client
from .base import open_error

T = TypeVar("T")


def run(async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``async_fn(*args)`` run to its end on this thread, with no event loop.

    For coroutines whose awaits all complete at once, as a
    :class:`BlockingClient`'s do.  RuntimeError if it suspends (it awaited
    trio, say): such code needs ``trio.run`` and :class:`meshd.Client`.
    """
    coro = async_fn(*args)
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError(f"{getattr(async_fn, '__name__', async_fn)} waited for an event loop; "
                       "run it with trio.run and meshd.Client")


class BlockingSocketStream:
    """A CallStream over a blocking Unix socket: its coroutines never suspend.

    It speaks the control socket's stream framing (:mod:`meshd.control.mux`)
    with one stream per connection: ``meshctl`` makes one call per process,
    so sharing a connection would save it nothing.  Closing the connection
    resets the stream.  Each operation waits at most until ``deadline``
    (``time.monotonic()``; None: no limit), then raises TimeoutError.
    """

    def __init__(self, sock: socket.socket, deadline: float | None):
        self._sock = sock
        self._deadline = deadline
        self._mux = Mux(client=True)
        self._state = self._mux.open()

    def _arm(self) -> None:
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self._sock.settimeout(left)

    def _flush(self) -> None:
        self._arm()
        try:
            self._sock.sendall(self._mux.data_to_send())
        except TimeoutError:
            raise
        except OSError as exc:
            raise StreamAborted(str(exc)) from None

    def _receive(self) -> None:
        """Read the socket once and apply what came (data, credit, the end)."""
        self._arm()
        try:
            data = self._sock.recv(1 << 16)
            if data:
                self._mux.receive_data(data)
        except TimeoutError:
            raise
        except (OSError, MuxError) as exc:
            raise StreamAborted(str(exc)) from None
        if not data:
            raise StreamAborted("the daemon closed the connection")

    async def send_all(self, data: bytes, eof: bool = False) -> None:
        view = memoryview(data)
        while True:
            if self._state.reset:
                raise StreamAborted("the daemon reset the call")
            view = view[self._mux.send(self._state, view, eof):]
            self._flush()
            if not view:
                return
            self._receive()  # until the daemon credits the window

    async def receive_some(self) -> bytes:
        while not self._state.readable:
            self._receive()
        if self._state.reset:
            raise StreamAborted("the daemon reset the call")
        data = self._mux.read(self._state, 1 << 16)
        if self._mux.wants_to_send:
            self._flush()
        return data

    async def close(self) -> None:
        self.abort()

    def abort(self) -> None:
        self._sock.close()

    def cancel_on_abort(self, scope: object) -> None:
        """Only a server watches for aborts; this stream is a caller's."""


class BlockingClient(Client):
    """:class:`meshd.Client` over a blocking socket; run its coroutines with :func:`run`."""

    async def _call(self, method: str, kind: int, arg: object, timeout: float | None) -> Framed:
        """A new connection with the call's REQUEST frame sent on it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(str(self.path))
        except TimeoutError:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            raise open_error(self.path, exc) from None
        framed = Framed(BlockingSocketStream(sock, deadline), MAX_FRAME)
        try:
            await framed.write(P.request_frame(method, timeout, kind, arg))
        except BaseException:
            sock.close()
            raise
        return framed

    async def request(self, method: str, arg: object = None, timeout: float | None = 60) -> object:
        """Call a control method of the daemon."""
        try:
            framed = await self._call(method, P.UNARY, arg, timeout)
            try:
                kind, value = await framed.read_answer("the daemon ended the call without a reply")
            finally:
                framed.stream.abort()
        except TimeoutError:
            raise DeadlineExceeded(f"{method} did not answer within {timeout} s") from None
        except (StreamAborted, FrameError) as exc:
            raise call_error(exc) from None
        if kind != P.REPLY:
            raise ProtocolViolation(f"expected a reply, got frame type {kind}")
        return value

    def stream(self, method: str, arg: object = None) -> BlockingResponseStream:
        """A server-streaming control method: ``async for item in client.stream(...)``."""
        return BlockingResponseStream(self, method, arg)


class BlockingResponseStream:
    """The items of a server-streaming call (``async for``, ``async with``), as
    :class:`meshd.rpc.ResponseStream` gives them; leaving early closes the
    connection, which cancels the daemon's handler."""

    def __init__(self, client: BlockingClient, method: str, arg: object):
        self._client = client
        self._method = method
        self._arg = arg
        self._framed: Framed | None = None
        self._done = False

    def __aiter__(self) -> BlockingResponseStream:
        return self

    async def __aenter__(self) -> BlockingResponseStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def __anext__(self) -> object:
        if self._done:
            raise StopAsyncIteration
        try:
            if self._framed is None:
                self._framed = await self._client._call(self._method, P.SERVER_STREAM, self._arg, None)
            kind, value = await self._framed.read_answer("the daemon ended the stream without END")
        except (StreamAborted, FrameError) as exc:
            await self.aclose()
            raise call_error(exc) from None
        except BaseException:
            await self.aclose()
            raise
        if kind == P.ITEM:
            return value
        await self.aclose()
        if kind == P.END:
            raise StopAsyncIteration
        raise ProtocolViolation(f"expected an item, got frame type {kind}")

    async def aclose(self) -> None:
        """Stop the call; the daemon's handler is cancelled if still running."""
        self._done = True
        if self._framed is not None:
            self._framed.stream.abort()
