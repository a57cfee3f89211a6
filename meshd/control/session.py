"""One control-socket connection carrying many calls: the trio shell over :mod:`.mux`.

The daemon runs :meth:`MuxSession.serve` per accepted connection: one task
reads frames and starts a handler per new stream.  A handler's frames go out
at once when the socket takes them and no write is under way; what the socket
does not take is left to a writer task, so a handler that is cancelled never
stops in the middle of a frame and no handler waits for another's bytes.
Sending at once saves the writer's scheduling round, in which the tasks the
handler started (a put's other stores, a write's pushes) would run first.
A client has no task of its own (:meth:`MuxSession.connect`): whichever of
its calls waits for bytes reads the socket for all of them, and writes go
out under a lock, shielded from cancellation so a frame is never cut in half
(the daemon always reads, so they finish at once).
"""

from __future__ import annotations

import socket
from typing import Awaitable, Callable

import trio

from ..streams import StreamAborted
from .mux import Mux, MuxError, StreamState

_READ = 1 << 16
_Closed = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class MuxSession:
    """The streams of one connection; see :class:`MuxStream` for one call's side."""

    def __init__(self, sock: trio.SocketStream, mux: Mux, raw: socket.socket | None = None):
        self._sock = sock
        self._raw = raw  # the same socket, for writes made at once (the client's RESETs, the daemon's replies)
        self._mux = mux
        self._read_lock = trio.Lock()
        self._send_lock = trio.Lock()
        self._changed = trio.Event()  # set (and replaced) whenever a stream may have moved
        self._output = trio.Event()  # server: set when the writer has frames to write
        self._writing = False  # server: the writer is in the middle of a write
        self._nursery: trio.Nursery | None = None
        self._watched: dict[StreamState, trio.CancelScope] = {}
        self.lost: str | None = None  # why the connection is gone

    # --- the client ---------------------------------------------------------------------

    @classmethod
    async def connect(cls, path: str) -> MuxSession:
        """A client connection to the control socket at ``path`` (OSError if none answers)."""
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock = trio.socket.from_stdlib_socket(raw)
            await sock.connect(path)
        except BaseException:
            raw.close()
            raise
        return cls(trio.SocketStream(sock), Mux(client=True), raw)

    async def open_stream(self) -> MuxStream:
        """A new stream for one call, once fewer than the limit are open.

        Raises StreamAborted if the connection is lost.
        """
        await self._wait(self._mux.can_open)
        return MuxStream(self, self._mux.open())

    async def aclose(self) -> None:
        """Close the connection; the daemon cancels whatever still runs on it."""
        self._lose("closed by this side")
        await self._sock.aclose()

    def discard(self) -> None:
        """Close a client connection without waiting (one a finished trio run left)."""
        self._lose("closed by this side")
        if self._raw is not None:
            trio.lowlevel.notify_closing(self._raw)  # wakes a call of ours blocked reading it
            self._raw.close()

    # --- the daemon ---------------------------------------------------------------------

    @classmethod
    def accepted(cls, sock: trio.SocketStream) -> MuxSession:
        """The daemon's side of a connection it accepted."""
        raw = socket.fromfd(sock.socket.fileno(), sock.socket.family, sock.socket.type)  # a dup
        raw.setblocking(False)
        return cls(sock, Mux(client=False), raw)

    async def serve(self, handle: Callable[[MuxStream], Awaitable[None]]) -> None:
        """Run ``handle(stream)`` for each stream the client opens, until the
        connection ends; then every handler still running is cancelled."""
        try:
            async with self._sock, trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._write_loop)
                async with self._read_lock:
                    while self.lost is None:
                        for state in await self._pump():
                            nursery.start_soon(handle, MuxStream(self, state))
                nursery.cancel_scope.cancel()
        finally:
            if self._raw is not None:
                self._raw.close()

    async def _write_loop(self) -> None:
        while True:
            await self._output.wait()
            self._output = trio.Event()
            data = self._mux.data_to_send()
            if data:
                self._writing = True
                try:
                    await self._sock.send_all(data)
                except _Closed as exc:
                    self._lose(f"control connection lost: {exc}")
                    return
                finally:
                    self._writing = False

    # --- both ---------------------------------------------------------------------------

    async def flush(self) -> None:
        """Send the frames queued so far (the daemon hands them to its writer).

        Raises StreamAborted if the connection is lost.
        """
        if self._nursery is not None:
            self.flush_nowait()
            return
        async with self._send_lock:
            while self.lost is None and self._mux.wants_to_send:
                try:
                    with trio.CancelScope(shield=True):
                        await self._sock.send_all(self._mux.data_to_send())
                except _Closed as exc:
                    self._lose(f"control connection lost: {exc}")
        if self.lost is not None:
            raise StreamAborted(self.lost)

    def flush_nowait(self) -> None:
        """Send the queued frames without waiting: what the socket takes now, unless a
        write is under way; the rest goes with the writer (daemon) or the next flush (client)."""
        if self._nursery is not None:  # the daemon
            if self._writing or self._raw is None or not self._send_now():
                self._output.set()
        elif self._raw is not None and not self._send_lock.locked():
            self._send_now()

    def _send_now(self) -> bool:
        """Write what the socket takes now; whether nothing is left queued."""
        if self.lost is not None:
            return True
        data = self._mux.data_to_send()
        try:
            sent = self._raw.send(data) if data else 0
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._lose(f"control connection lost: {exc}")
            return True
        if sent < len(data):
            self._mux.requeue(data[sent:])
            return False
        return True

    def watch(self, state: StreamState, scope: trio.CancelScope | None) -> None:
        """Cancel ``scope`` when the peer resets ``state`` or the connection is lost."""
        if scope is None:
            self._watched.pop(state, None)
        else:
            self._watched[state] = scope

    async def _wait(self, ready: Callable[[], bool]) -> None:
        """Return once ``ready()``; read the socket meanwhile unless another task does."""
        while not ready():
            if self.lost is not None:
                raise StreamAborted(self.lost)
            if self._read_lock.locked():
                await self._changed.wait()
                continue
            try:
                async with self._read_lock:
                    await self._pump()
            finally:
                self._signal()

    async def _pump(self) -> list[StreamState]:
        """Read the socket once and apply what came; returns the streams the peer opened."""
        try:
            data = await self._sock.receive_some(_READ)
        except _Closed as exc:
            data, why = b"", f"control connection lost: {exc}"
        else:
            why = "the other side closed the control connection"
        opened: list[StreamState] = []
        if data:
            try:
                opened = self._mux.receive_data(data)
            except MuxError as exc:
                why, data = f"control connection closed: {exc}", b""
                await self._sock.aclose()
        if not data:
            self._lose(why)
        if self._mux.wants_to_send:
            self.flush_nowait()
        for state, scope in list(self._watched.items()):
            if state.reset:
                scope.cancel()
                del self._watched[state]
        self._signal()
        return opened

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            self._mux.connection_lost()
            for scope in self._watched.values():
                scope.cancel()
            self._watched.clear()
            self._signal()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


class MuxStream:
    """A CallStream on a :class:`MuxSession`: one call's stream.

    Unlike a whole Unix socket it can end one direction (END, like a QUIC
    FIN) and be reset (RESET), so ``eof`` and aborts mean what they mean on
    a QUIC stream.
    """

    __slots__ = ("_session", "_state")

    def __init__(self, session: MuxSession, state: StreamState):
        self._session = session
        self._state = state

    async def send_all(self, data: bytes, eof: bool = False) -> None:
        session, state, mux = self._session, self._state, self._session._mux
        view = memoryview(data)
        while True:
            if state.reset:
                raise StreamAborted(session.lost or "the stream was reset")
            taken = mux.send(state, view, eof)
            view = view[taken:]
            if taken or (eof and not view):
                await session.flush()
            if not view:
                return
            await session._wait(lambda: state.reset or state.send_window > 0)

    async def receive_some(self) -> bytes:
        session, state = self._session, self._state
        await session._wait(lambda: state.readable)
        if state.reset:
            raise StreamAborted(session.lost or "the stream was reset")
        data = session._mux.read(state, _READ)
        if session._mux.wants_to_send:
            await session.flush()
        return data

    async def close(self) -> None:
        self._session.watch(self._state, None)
        self._session._mux.close(self._state)
        try:
            await self._session.flush()
        except StreamAborted:
            pass  # nothing more was owed on a connection that is gone

    def abort(self) -> None:
        self._session.watch(self._state, None)
        self._session._mux.reset(self._state)
        self._session.flush_nowait()

    def cancel_on_abort(self, scope: trio.CancelScope | None) -> None:
        if scope is not None and self._state.reset:
            scope.cancel()
        else:
            self._session.watch(self._state, scope)
