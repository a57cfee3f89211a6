"""A STUN client transaction over UDP (RFC 8489 section 6.2.1), with no I/O and no clock.

The caller owns the socket and the clock and feeds both in::

    tx = ClientTransaction(binding_request().encode(), now)
    while not tx.done:
        if (datagram := tx.datagram_to_send(now)) is not None:
            send(datagram)
        # wait for a datagram or until tx.wake_time, then:
        tx.handle_response(decode(reply))   # for each STUN reply that arrived
        tx.timeout(now)
    response = tx.result()                  # or TransactionTimeout

The request goes out at once, then again after RTO, 2*RTO, 4*RTO... until
Rc requests have been sent; if nothing answers within Rm*RTO after the last
one, the transaction has failed.  With the defaults (RTO 0.5 s, Rc 7, Rm 16)
requests leave at 0, 0.5, 1.5, 3.5, 7.5, 15.5 and 31.5 s and it fails at 39.5 s.
"""

from __future__ import annotations

from .stun import StunClass, StunMessage, parse_header

RTO = 0.5
"""Initial retransmission timeout in seconds (RFC 8489: at least 500 ms)."""
RC = 7
"""Requests sent in all, the first one included."""
RM = 16
"""The wait after the last request, in multiples of the initial RTO."""


class TransactionTimeout(Exception):
    """No response arrived before the wait after the last request ran out."""


class ClientTransaction:
    """The retransmission state of one request: when to send it, and how it ended.

    ``datagram`` is the encoded request (class REQUEST; ValueError otherwise)
    and ``now`` the time on the caller's clock, in seconds, when it may first
    be sent.  ``rto``, ``rc`` and ``rm`` override RTO, RC and RM.  A response
    ends the transaction when it carries the request's transaction id and
    method and a response class; anything else is ignored.
    """

    def __init__(self, datagram: bytes, now: float, *, rto: float = RTO, rc: int = RC, rm: float = RM) -> None:
        header = parse_header(datagram)
        if header.cls != StunClass.REQUEST:
            raise ValueError(f"a client transaction sends a request, not a {header.cls.name.lower()} message")
        if rto <= 0 or rc < 1 or rm <= 0:
            raise ValueError(f"need rto > 0, rc >= 1 and rm > 0 (got rto={rto}, rc={rc}, rm={rm})")
        self.datagram = bytes(datagram)
        self.transaction_id = header.transaction_id
        self.method = header.method
        self._rto = rto
        self._rc = rc
        self._rm = rm
        self._sent = 0
        self._next_send: float | None = now
        self._deadline: float | None = None
        self._response: StunMessage | None = None
        self._timed_out = False

    @property
    def requests_sent(self) -> int:
        """How many times the request has been handed out so far."""
        return self._sent

    @property
    def next_send_time(self) -> float | None:
        """When ``datagram_to_send`` will next return the request; None once no more sends are due."""
        return self._next_send

    @property
    def deadline(self) -> float | None:
        """When the transaction fails without a response; set once the last request is out, None when done."""
        return self._deadline

    @property
    def wake_time(self) -> float | None:
        """When the caller should next call ``datagram_to_send`` and ``timeout``; None when done."""
        return self._next_send if self._next_send is not None else self._deadline

    @property
    def done(self) -> bool:
        """Whether a response arrived or the transaction timed out."""
        return self._response is not None or self._timed_out

    def datagram_to_send(self, now: float) -> bytes | None:
        """The request if a (re)transmission is due at ``now``, else None.

        Each send schedules the next from ``now``: RTO after the first, then
        doubling; after the Rc-th it sets the deadline to ``now + Rm * RTO``.
        """
        if self._next_send is None or now < self._next_send:
            return None
        self._sent += 1
        if self._sent < self._rc:
            self._next_send = now + self._rto * 2 ** (self._sent - 1)
        else:
            self._next_send = None
            self._deadline = now + self._rm * self._rto
        return self.datagram

    def handle_response(self, message: StunMessage) -> bool:
        """Take ``message`` as the answer if it is one to this request; return whether it was.

        A success or error response with this transaction id and method ends
        the transaction (no more retransmissions); other messages, and any
        message once the transaction is done, change nothing.
        """
        if self.done or not self._answers(message):
            return False
        self._response = message
        self._next_send = None
        self._deadline = None
        return True

    def timeout(self, now: float) -> bool:
        """Fail the transaction if its deadline has passed by ``now``; return whether it has timed out."""
        if self._deadline is not None and now >= self._deadline:
            self._deadline = None
            self._timed_out = True
        return self._timed_out

    def result(self) -> StunMessage:
        """The response (success or error class); TransactionTimeout if none came, RuntimeError if still running."""
        if self._response is not None:
            return self._response
        if self._timed_out:
            raise TransactionTimeout(
                f"no response to transaction {self.transaction_id.hex()} after {self._sent} requests"
            )
        raise RuntimeError("the transaction is still running")

    def _answers(self, message: StunMessage) -> bool:
        """Whether ``message`` is a response to this transaction's request."""
        return (
            message.transaction_id == self.transaction_id
            and message.method == self.method
            and message.cls in (StunClass.SUCCESS, StunClass.ERROR)
        )
