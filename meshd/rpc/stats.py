"""Per-method figures of the calls a node serves and makes: latency, errors, bytes.

:class:`CallStats` is what :class:`meshd.rpc.RpcServer` and
:class:`meshd.rpc.PeerRpc` report to once something asked for figures
(``observe``); until then they report nothing and pay one ``is None`` test
per call.  It is plain data updated on the trio thread; :meth:`snapshot`
copies it for whoever reads it elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..histogram import Histogram
from ..streams import StreamAborted
from ..wire import FrameError, FrameTooLarge
from .errors import RpcError

if TYPE_CHECKING:
    import trio

    from ..streams import CallStream

MAX_METHODS = 256  # distinct method names kept per table; calls to more count under OTHER
OTHER = "(other)"
OK = "OK"


class _Method:
    __slots__ = ("latency", "errors", "received", "sent")

    def __init__(self):
        self.latency = Histogram()
        self.errors: dict[str, int] = {}
        self.received = 0
        self.sent = 0


class CallTable:
    """Calls by method name: a latency histogram, errors by code, bytes each way."""

    def __init__(self, max_methods: int = MAX_METHODS):
        self._max = max_methods
        self._methods: dict[str, _Method] = {}

    def add(self, method: str, seconds: float, code: str, received: int, sent: int) -> None:
        """Count one finished call; ``code`` is OK or the error's wire code."""
        entry = self._methods.get(method)
        if entry is None:
            if len(self._methods) >= self._max:
                method = OTHER
            entry = self._methods.get(method) or self._methods.setdefault(method, _Method())
        entry.latency.observe(seconds)
        if code != OK:
            entry.errors[code] = entry.errors.get(code, 0) + 1
        entry.received += received
        entry.sent += sent

    def snapshot(self) -> dict:
        """``{method: {"latency": histogram snapshot, "errors": {code: n}, "received": bytes,
        "sent": bytes}}``, copied."""
        return {name: {"latency": m.latency.snapshot(), "errors": dict(m.errors),
                       "received": m.received, "sent": m.sent}
                for name, m in self._methods.items()}


class CallStats:
    """The calls this node served (``served``) and made (``called``)."""

    def __init__(self, max_methods: int = MAX_METHODS):
        self.served = CallTable(max_methods)
        self.called = CallTable(max_methods)

    def snapshot(self) -> dict:
        return {"served": self.served.snapshot(), "called": self.called.snapshot()}


def outcome(exc: BaseException) -> str:
    """The code a call that ended with ``exc`` counts under: the RpcError's
    wire code, the code a transport or framing failure becomes, CANCELLED for a
    cancellation, INTERNAL for anything else."""
    if isinstance(exc, RpcError):
        return exc.code
    if isinstance(exc, StreamAborted):
        return "UNAVAILABLE"
    if isinstance(exc, FrameTooLarge):
        return "FRAME_TOO_LARGE"
    if isinstance(exc, FrameError):
        return "PROTOCOL_ERROR"
    return "INTERNAL" if isinstance(exc, Exception) else "CANCELLED"


class CountingStream:
    """A CallStream that counts the bytes passing through it (a caller's figures)."""

    __slots__ = ("_stream", "received", "sent")

    def __init__(self, stream: CallStream):
        self._stream = stream
        self.received = 0
        self.sent = 0

    async def send_all(self, data: bytes, eof: bool = False) -> None:
        self.sent += len(data)
        await self._stream.send_all(data, eof)

    async def receive_some(self) -> bytes:
        data = await self._stream.receive_some()
        self.received += len(data)
        return data

    async def close(self) -> None:
        await self._stream.close()

    def abort(self) -> None:
        self._stream.abort()

    def cancel_on_abort(self, scope: trio.CancelScope | None) -> None:
        self._stream.cancel_on_abort(scope)
