"""The one place where the NAT cores' refusals become meshd RPC errors.

The sans-IO cores raise :class:`nat.errors.NatError` with a ``kind``; the
shells let it through :func:`rpc_errors` (requests from peers) or turn a
peer's malformed *reply* into :class:`~meshd.rpc.Unavailable` with
:func:`bad_reply`, so a caller that catches RpcError keeps working.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from nat.errors import Malformed, NatError

from ...address import AddressError, HostPort
from ...rpc import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, RpcError, Unavailable

_BY_KIND: dict[str, type[RpcError]] = {
    "disabled": PermissionDenied,
    "full": ResourceExhausted,
    "no_reservation": NotFound,
    "busy": ResourceExhausted,
    "too_soon": ResourceExhausted,
    "pointless": ResourceExhausted,
    "not_relayed": InvalidArgument,
    "malformed": InvalidArgument,
}


def rpc_error(exc: NatError) -> RpcError:
    """The RPC error a core's refusal or fault is answered with; the message is ``str(exc)``."""
    return _BY_KIND[exc.kind](str(exc))


@contextmanager
def rpc_errors() -> Iterator[None]:
    """Raise :func:`rpc_error` of any NatError raised inside (serving a peer's request)."""
    try:
        yield
    except NatError as exc:
        raise rpc_error(exc) from None


@contextmanager
def bad_reply(peer: object, method: str) -> Iterator[None]:
    """Raise Unavailable for a Malformed raised inside (checking ``peer``'s reply to ``method``)."""
    try:
        yield
    except Malformed as exc:
        raise Unavailable(f"{peer} answered {method} malformed: {exc}") from None


def parse_hostport(text: str) -> HostPort:
    """A HOST:PORT text from the network; Malformed when it is not one."""
    try:
        return HostPort.parse(text)
    except AddressError as exc:
        raise Malformed(str(exc)) from None
