"""An in-memory CallStream pair, standing in for QUIC in unit tests of the RPC layer."""

from __future__ import annotations

import trio

from meshd.streams import StreamAborted


class MemoryCallStream:
    """One end of an in-memory stream with QUIC-like reset and end-of-stream."""

    def __init__(self) -> None:
        self.peer: MemoryCallStream | None = None
        self._buf = bytearray()
        self._eof = False
        self._aborted = False
        self._closed = False
        self._lot = trio.lowlevel.ParkingLot()
        self._watch: trio.CancelScope | None = None

    async def send_all(self, data: bytes, eof: bool = False) -> None:
        await trio.lowlevel.checkpoint()
        if self._aborted or self.peer._aborted or self._closed:
            raise StreamAborted("stream is gone")
        self.peer._buf += data
        self.peer._lot.unpark_all()
        if eof:
            self._closed = True
            self.peer._end()

    async def receive_some(self) -> bytes:
        await trio.lowlevel.checkpoint()
        while not self._buf and not self._eof and not self._aborted:
            await self._lot.park()
        if self._aborted:
            raise StreamAborted("reset")
        data = bytes(self._buf)
        self._buf.clear()
        return data

    async def close(self) -> None:
        await trio.lowlevel.checkpoint()
        if not self._closed:
            self._closed = True
            self.peer._end()

    def abort(self) -> None:
        self._aborted = True
        self._lot.unpark_all()
        self.peer._reset()

    def cancel_on_abort(self, scope: trio.CancelScope | None) -> None:
        self._watch = scope
        if scope is not None and self._aborted:
            scope.cancel()

    def _end(self) -> None:
        self._eof = True
        self._lot.unpark_all()

    def _reset(self) -> None:
        self._aborted = True
        if self._watch is not None:
            self._watch.cancel()
        self._lot.unpark_all()


def memory_call_stream_pair() -> tuple[MemoryCallStream, MemoryCallStream]:
    a, b = MemoryCallStream(), MemoryCallStream()
    a.peer, b.peer = b, a
    return a, b
