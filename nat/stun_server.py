"""Answering STUN Binding requests, with no I/O: bytes and an address in, a reply out.

Every meshd answers Binding requests on its QUIC port, so any reachable peer
is a STUN server for the others.  Only Binding is served, without
authentication (RFC 8489 section 12: a Binding request needs none).
"""

from __future__ import annotations

from .stun import (
    BINDING,
    StunClass,
    StunError,
    UnknownAttributesError,
    binding_success,
    decode,
    error_response,
)


def answer(data: bytes, source: tuple) -> bytes | None:
    """The reply to ``data`` received from ``source`` (host, port), or None.

    A Binding request gets a success response carrying ``source`` as its
    XOR-MAPPED-ADDRESS; a request we cannot serve gets an error response (420
    with the unknown attributes, 400 otherwise); anything that is not a
    request, or too broken to answer, gets nothing.
    """
    try:
        message = decode(data)
    except UnknownAttributesError as exc:
        return _error(exc.parsed, 420, "Unknown Attribute", exc.unknown)
    except StunError as exc:
        return _error(exc.parsed, 400, "Bad Request")
    if message.cls != StunClass.REQUEST:
        return None
    if message.method != BINDING:
        return _error(message, 400, "only Binding is served here")
    return binding_success(message, (source[0], source[1])).encode()


def _error(request, code: int, reason: str, unknown: tuple[int, ...] = ()) -> bytes | None:
    if request is None or request.cls != StunClass.REQUEST:
        return None
    return error_response(request, code, reason, unknown).encode()
