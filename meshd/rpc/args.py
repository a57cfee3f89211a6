"""Checks of request arguments, written once for every handler of peer or local input.

Each function takes the decoded argument of a call (anything msgpack can
carry) and returns the field asked for, or raises InvalidArgument with a
message that names what was expected, so a malformed request costs the caller
its call and nothing else.
"""

from __future__ import annotations

from ..address import AddressError, HostPort
from ..identity import PeerId, PeerIdError
from .errors import InvalidArgument


def field(arg: object, name: str, kind: type | tuple[type, ...]) -> object:
    """``arg[name]`` if ``arg`` is a map and the value is of ``kind``."""
    if not isinstance(arg, dict) or not isinstance(arg.get(name), kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise InvalidArgument(f"expected {{{name!r}: {' or '.join(k.__name__ for k in kinds)}}}")
    return arg[name]


def optional(arg: object, name: str, kind: type | tuple[type, ...]) -> object:
    """``arg[name]`` checked as :func:`field` does, or None when absent or null."""
    if isinstance(arg, dict) and arg.get(name) is None:
        return None
    return field(arg, name, kind)


def to_peer(value: object) -> PeerId:
    """A PeerId from its text (or a PeerId as it is)."""
    if isinstance(value, PeerId):
        return value
    try:
        return PeerId.from_string(value)
    except (PeerIdError, AttributeError, TypeError) as exc:
        raise InvalidArgument(f"not a PeerId: {exc}") from None


def peer_field(arg: object, name: str = "peer") -> PeerId:
    """The PeerId at ``arg[name]``."""
    return to_peer(field(arg, name, str))


def hostport_field(arg: object, name: str) -> HostPort:
    """The HOST:PORT at ``arg[name]``."""
    try:
        return HostPort.parse(field(arg, name, str))
    except AddressError as exc:
        raise InvalidArgument(str(exc)) from None
