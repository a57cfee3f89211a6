"""Bidirectional-streaming calls: both sides send and receive items at will.

A bidi call starts like the others (REQUEST with kind BIDI and an argument),
then each side sends ITEM frames and ends its direction with END.  The server
handler is ``async def h(channel, ctx)``; returning ends the server's
direction.  The caller uses ``async with rpc.bidi(peer, method, arg) as ch``.
Sending and receiving may happen in different tasks at once.
"""

from __future__ import annotations

import trio

from ..streams import StreamAborted
from . import protocol as P
from .errors import ProtocolViolation
from .framed import Framed, connection_lost


class Channel:
    """One side of a bidi call: ``send``/``end`` our items, ``receive`` theirs."""

    def __init__(self, framed: Framed, *, caller: bool, arg: object = None):
        self._framed = framed
        self._caller = caller
        self.arg = arg  # on the server side: the argument the caller started the call with
        self.ended = False  # our direction is over

    async def send(self, item: object) -> None:
        """Send one item; FrameTooLarge if it is too large.  A lost stream raises
        Unavailable on the caller's side (as every lost call does), StreamAborted
        on the server's."""
        if self.ended:
            raise trio.ClosedResourceError("this side of the channel has ended")
        await self._write([P.ITEM, item])

    async def end(self) -> None:
        """End our direction (the peer's ``receive`` raises EndOfChannel after our items)."""
        if not self.ended:
            self.ended = True
            await self._write(P.END_FRAME, eof=True)

    async def _write(self, frame: object, eof: bool = False) -> None:
        try:
            await self._framed.write(frame, eof=eof)
        except StreamAborted as exc:
            if not self._caller:
                raise
            raise connection_lost(exc) from None

    async def receive(self) -> object:
        """The peer's next item; trio.EndOfChannel once it has ended its direction.

        On the caller's side a server failure raises its RpcError and a lost
        stream Unavailable.
        """
        kind, value = await self._framed.read_answer("peer ended the stream without END",
                                                      errors=self._caller)
        self._framed.let_go()  # held (by a served call) while it arrived, now handed on
        if kind == P.ITEM:
            return value
        if kind == P.END:
            raise trio.EndOfChannel
        raise ProtocolViolation(f"unexpected frame type {kind} in a bidi call")

    def __aiter__(self) -> "Channel":
        return self

    async def __anext__(self) -> object:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
