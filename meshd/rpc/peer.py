"""``node.rpc``: register handlers and call methods on peers by PeerId."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterable, Awaitable, Callable, Iterable, Protocol

import trio

from ..identity import PeerId
from ..streams import CallStream, StreamAborted
from .args import to_peer
from .client import ResponseStream, bidi_call, client_stream_call, unary_call
from .server import RpcServer
from .stats import OK, CallStats, CallTable, CountingStream, outcome

_DEFAULT = object()
_MAX_OPENERS = 4096


@dataclass
class RpcConfig:
    max_frame: int = 16 << 20
    max_calls_per_peer: int = 256
    default_timeout: float = 30.0
    # seconds a new stream has to deliver its request, then it is ended
    first_frame_timeout: float = field(default=10.0, metadata={"above": 0, "max": 3600.0})
    # seconds a served call may run at most, whatever deadline its caller sent
    max_call_timeout: float = field(default=3600.0, metadata={"above": 0, "max": 86400.0})
    # calls running at once from which the node is busy: then a peer running peer_share or more
    # waits its turn, the peer with fewest calls in flight first (rpc/fair.py)
    busy_calls: int = field(default=32, metadata={"min": 1, "max": 1 << 20})
    # calls each peer may run at once however busy the node is (16: a relay's circuits to one
    # target, at most relay.max_circuits, never wait)
    peer_share: int = field(default=16, metadata={"min": 1, "max": 1 << 20})
    # bytes the calls served to one peer may hold at once (requests, answers not yet sent), and
    # to all peers: a frame of 64 KiB or more past either is refused, not waited for (rpc/budget.py)
    peer_held_bytes: int = field(default=32 << 20, metadata={"min": 1 << 20, "max": 1 << 40})
    held_bytes: int = field(default=256 << 20, metadata={"min": 1 << 20, "max": 1 << 40})
    # ... and the calls of all peers at one IP address (loopback not counted unless
    # transport.limit_loopback): fresh identities on one machine share it
    address_held_bytes: int = field(default=64 << 20, metadata={"min": 1 << 20, "max": 1 << 40})


class _Connection(Protocol):
    def open_stream(self) -> CallStream: ...


class PeerRpc:
    """Calls to peers over their one shared connection, and the local handler registry.

    ``connection(peer)`` returns the live connection to a peer, dialing if
    needed (the node's); PeerRpc opens one stream per call on it.
    """

    def __init__(self, connection: Callable[[PeerId], Awaitable[_Connection]], config: RpcConfig):
        self._connection = connection
        self._config = config
        self._openers: dict[PeerId, Callable] = {}
        self.server = RpcServer(
            max_frame=config.max_frame, max_calls_per_peer=config.max_calls_per_peer,
            first_frame_timeout=config.first_frame_timeout, max_call_timeout=config.max_call_timeout,
            busy_calls=config.busy_calls, peer_share=config.peer_share,
            held_bytes=config.held_bytes, peer_held_bytes=config.peer_held_bytes,
            address_held_bytes=config.address_held_bytes,
        )
        self._observer: CallTable | None = None

    def observe(self, stats: CallStats | None) -> None:
        """From now on, count every call served in ``stats.served`` and every
        unary and client-streaming call made in ``stats.called``; None stops counting."""
        self.server.observer = None if stats is None else stats.served
        self._observer = None if stats is None else stats.called

    def register(self, name: str, handler: Callable, *, kind: str | None = None) -> None:
        """Serve ``name``; see :class:`meshd.rpc.RpcServer.register` for handler shapes."""
        self.server.register(name, handler, kind=kind)

    def unregister(self, name: str) -> None:
        self.server.unregister(name)

    def _opener(self, peer: PeerId | str):
        """An async callable that opens a stream to ``peer`` (one per peer, reused)."""
        peer = to_peer(peer)
        opener = self._openers.get(peer)
        if opener is None:
            connection = self._connection

            async def opener():
                try:
                    return (await connection(peer)).open_stream()
                except StreamAborted:  # closed between lookup and use: dial again once
                    return (await connection(peer)).open_stream()

            if len(self._openers) >= _MAX_OPENERS:
                self._openers.clear()
            self._openers[peer] = opener
        return opener

    def _timeout(self, timeout: object) -> float | None:
        return self._config.default_timeout if timeout is _DEFAULT else timeout

    async def call(self, peer: PeerId | str, method: str, arg: object = None, *,
                   timeout: float | None = _DEFAULT) -> object:  # type: ignore[assignment]
        """Unary call; returns the reply or raises the peer's typed RpcError."""
        if self._observer is None:
            return await unary_call(self._opener(peer), method, arg, self._timeout(timeout),
                                    self._config.max_frame)
        return await self._counted(unary_call, peer, method, arg, self._timeout(timeout))

    def stream(self, peer: PeerId | str, method: str, arg: object = None, *,
               timeout: float | None = None) -> ResponseStream:
        """Server-streaming call: ``async for item in node.rpc.stream(...)``."""
        return ResponseStream(self._opener(peer), method, arg, timeout, self._config.max_frame)

    def bidi(self, peer: PeerId | str, method: str, arg: object = None, *,
             timeout: float | None = None):
        """Bidirectional call: ``async with node.rpc.bidi(...) as channel``."""
        return bidi_call(self._opener(peer), method, arg, timeout, self._config.max_frame)

    async def client_stream(self, peer: PeerId | str, method: str,
                            items: AsyncIterable | Iterable, *,
                            timeout: float | None = _DEFAULT) -> object:  # type: ignore[assignment]
        """Client-streaming call: send ``items``, get one reply."""
        if self._observer is None:
            return await client_stream_call(self._opener(peer), method, items,
                                            self._timeout(timeout), self._config.max_frame)
        return await self._counted(client_stream_call, peer, method, items, self._timeout(timeout))

    async def _counted(self, make_call: Callable, peer: PeerId | str, method: str, arg: object,
                       timeout: float | None) -> object:
        """``make_call(opener, method, arg, timeout, max_frame)``, counted in the
        observer: its time, how it ended, and the bytes of every stream it opened."""
        table, opener, streams = self._observer, self._opener(peer), []

        async def counted_opener() -> CountingStream:
            streams.append(CountingStream(await opener()))
            return streams[-1]

        started, code = trio.current_time(), OK
        try:
            return await make_call(counted_opener, method, arg, timeout, self._config.max_frame)
        except BaseException as exc:
            code = outcome(exc)
            raise
        finally:
            table.add(method, trio.current_time() - started, code,
                      sum(s.received for s in streams), sum(s.sent for s in streams))
