"""``node.rpc``: register handlers and call methods on peers by PeerId."""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterable, Callable, Iterable

from .config import RpcConfig
from .identity import PeerId, PeerIdError
from .rpc import (
    InvalidArgument,
    ResponseStream,
    RpcServer,
    bidi_call,
    client_stream_call,
    unary_call,
)
from .streams import StreamAborted

if TYPE_CHECKING:
    from .node import Node

_DEFAULT = object()
_MAX_OPENERS = 4096


class PeerRpc:
    """Calls to peers over their one shared connection, and the local handler registry."""

    def __init__(self, node: "Node", config: RpcConfig):
        self._node = node
        self._config = config
        self._openers: dict[PeerId, Callable] = {}
        self.server = RpcServer(
            max_frame=config.max_frame, max_calls_per_peer=config.max_calls_per_peer
        )

    def register(self, name: str, handler: Callable, *, kind: str | None = None) -> None:
        """Serve ``name``; see :class:`meshd.rpc.RpcServer.register` for handler shapes."""
        self.server.register(name, handler, kind=kind)

    def unregister(self, name: str) -> None:
        self.server.unregister(name)

    def _opener(self, peer: PeerId | str):
        """An async callable that opens a stream to ``peer`` (one per peer, reused)."""
        peer = _peer(peer)
        opener = self._openers.get(peer)
        if opener is None:
            node = self._node

            async def opener():
                conn = node._conns.get(peer)
                if conn is None or conn.close_reason is not None:
                    conn = await node.connection(peer)
                try:
                    return conn.open_stream()
                except StreamAborted:  # closed between lookup and use: dial again once
                    return (await node.connection(peer)).open_stream()

            if len(self._openers) >= _MAX_OPENERS:
                self._openers.clear()
            self._openers[peer] = opener
        return opener

    def _timeout(self, timeout: object) -> float | None:
        return self._config.default_timeout if timeout is _DEFAULT else timeout

    async def call(self, peer: PeerId | str, method: str, arg: object = None, *,
                   timeout: float | None = _DEFAULT) -> object:  # type: ignore[assignment]
        """Unary call; returns the reply or raises the peer's typed RpcError."""
        return await unary_call(self._opener(peer), method, arg, self._timeout(timeout),
                                self._config.max_frame)

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
        return await client_stream_call(self._opener(peer), method, items,
                                        self._timeout(timeout), self._config.max_frame)


def _peer(peer: PeerId | str) -> PeerId:
    if isinstance(peer, PeerId):
        return peer
    try:
        return PeerId.from_string(peer)
    except (PeerIdError, AttributeError) as exc:
        raise InvalidArgument(f"not a PeerId: {exc}") from None
