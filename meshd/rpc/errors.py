"""Typed RPC errors: each has a code that travels on the wire and a message.

A handler raises one of these to send that code to the caller; the caller
gets the same class back.  Any other exception in a handler reaches the caller
as INTERNAL with the exception's type name, never a traceback.
"""

from __future__ import annotations


class RpcError(Exception):
    """A failed call.  ``code`` is the wire code, ``message`` the reason."""

    code = "UNKNOWN"

    def __init__(self, message: str = "", *, code: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.message}" if self.message else self.code


class Cancelled(RpcError):
    code = "CANCELLED"


class UnknownMethod(RpcError):
    code = "UNKNOWN_METHOD"


class InvalidArgument(RpcError):
    code = "INVALID_ARGUMENT"


class DeadlineExceeded(RpcError):
    code = "DEADLINE_EXCEEDED"


class ResourceExhausted(RpcError):
    code = "RESOURCE_EXHAUSTED"


class FrameTooLargeError(RpcError):
    code = "FRAME_TOO_LARGE"


class ProtocolViolation(RpcError):
    code = "PROTOCOL_ERROR"


class PermissionDenied(RpcError):
    code = "PERMISSION_DENIED"


class NotFound(RpcError):
    code = "NOT_FOUND"


class Unavailable(RpcError):
    """The peer could not be reached, or the connection was lost mid-call.

    ``unprocessed`` is true when the peer closed the connection without having
    seen the call (it had been replaced by another connection): sending the
    call again is safe, and the RPC client does so once by itself.
    """

    code = "UNAVAILABLE"
    unprocessed = False


class Internal(RpcError):
    code = "INTERNAL"


_BY_CODE = {
    cls.code: cls
    for cls in (
        Cancelled, UnknownMethod, InvalidArgument, DeadlineExceeded, ResourceExhausted,
        FrameTooLargeError, ProtocolViolation, PermissionDenied, NotFound, Unavailable,
        Internal,
    )
}


def error_from_wire(code: str, message: str) -> RpcError:
    """The exception for a code received from a peer (RpcError for unknown codes)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return RpcError(message, code=code)
    return cls(message)
