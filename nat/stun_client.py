"""A STUN Binding client on a socket that someone else reads (trio).

The owner of the UDP socket passes every STUN datagram that arrives to
:meth:`StunClient.datagram_received` and gives the client a ``send``
function, so Binding requests leave from the same socket (and NAT mapping)
that QUIC uses.  Retransmission follows RFC 8489 (see ``nat.transaction``).
"""

from __future__ import annotations

from typing import Callable

import trio

from .stun import StunClass, StunError, binding_request, decode
from .transaction import RC, RM, RTO, ClientTransaction, TransactionTimeout


class StunFailure(Exception):
    """A Binding request got an error response, a useless answer, or none."""


class StunClient:
    """Binding requests over a shared socket; results are reflexive addresses."""

    def __init__(self, send: Callable[[bytes, tuple], None], *, rto: float = RTO, rc: int = RC,
                 rm: float = RM):
        self._send = send
        self._rto, self._rc, self._rm = rto, rc, rm
        self._pending: dict[bytes, tuple[ClientTransaction, trio.Event]] = {}

    def datagram_received(self, data: bytes, source: tuple) -> bool:
        """Hand over a STUN datagram; True if it answered one of our requests."""
        try:
            message = decode(data)
        except StunError:
            return False
        if message.cls not in (StunClass.SUCCESS, StunClass.ERROR):
            return False
        pending = self._pending.get(message.transaction_id)
        if pending is None or not pending[0].handle_response(message):
            return False
        pending[1].set()
        return True

    async def binding(self, server: tuple) -> tuple[str, int]:
        """Our address as ``server`` (host, port) sees it: the reflexive address.

        Retransmits on RFC 8489's schedule (39.5 s in all by default) and
        raises StunFailure on timeout, an error response, or a response
        without a mapped address.  Cancel it to give up sooner.
        """
        request = binding_request()
        tx = ClientTransaction(request.encode(), trio.current_time(), rto=self._rto, rc=self._rc,
                               rm=self._rm)
        answered = trio.Event()
        self._pending[request.transaction_id] = (tx, answered)
        try:
            while not tx.done:
                datagram = tx.datagram_to_send(trio.current_time())
                if datagram is not None:
                    self._send(datagram, server)
                with trio.move_on_at(tx.wake_time):
                    await answered.wait()
                tx.timeout(trio.current_time())
        finally:
            del self._pending[request.transaction_id]
        try:
            response = tx.result()
        except TransactionTimeout:
            raise StunFailure(f"no STUN answer from {server[0]}:{server[1]} "
                              f"after {tx.requests_sent} requests") from None
        if response.cls == StunClass.ERROR:
            code, reason = response.error_code or (0, "no ERROR-CODE")
            raise StunFailure(f"{server[0]}:{server[1]} answered {code} {reason}")
        mapped = response.xor_mapped_address or response.mapped_address
        if mapped is None:
            raise StunFailure(f"{server[0]}:{server[1]} answered without a mapped address")
        return mapped
