"""The RPC frames, built and validated without any I/O.

One call uses one bidirectional stream.  Every frame is a msgpack array whose
first element is its type:

    REQUEST  [0, method, timeout_ms | None, kind, arg]   client -> server, first frame
    REPLY    [1, value]                                   the result of a unary or
                                                          client-streaming call
    ITEM     [2, value]                                   one streamed message, either way
    END      [3]                                          end of a stream of ITEMs
    ERROR    [4, code, message]                           server -> client, final

After its last frame (REQUEST, or END of a client stream or bidi call) the
caller ends its sending side.  A caller that gives up resets the stream (QUIC RESET_STREAM and
STOP_SENDING), or on the Unix control socket closes the connection, and the
server cancels the handler.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ProtocolViolation

REQUEST, REPLY, ITEM, END, ERROR = range(5)
UNARY, SERVER_STREAM, CLIENT_STREAM, BIDI = range(4)
KIND_NAMES = {UNARY: "unary", SERVER_STREAM: "server_stream", CLIENT_STREAM: "client_stream",
              BIDI: "bidi"}

MAX_METHOD_LEN = 128
MAX_TIMEOUT_MS = 24 * 3600 * 1000
END_FRAME = [END]


@dataclass(frozen=True)
class Request:
    method: str
    timeout: float | None  # seconds, as the caller sent it
    kind: int
    arg: object


def request_frame(method: str, timeout: float | None, kind: int, arg: object) -> list:
    timeout_ms = None if timeout is None else max(0, int(timeout * 1000))
    return [REQUEST, method, timeout_ms, kind, arg]


def parse_request(frame: object) -> Request:
    """Validate a REQUEST frame from a peer, or raise ProtocolViolation."""
    if not isinstance(frame, list) or len(frame) != 5 or frame[0] != REQUEST:
        raise ProtocolViolation("first frame of a call must be [0, method, timeout_ms, kind, arg]")
    _, method, timeout_ms, kind, arg = frame
    if not isinstance(method, str) or not 0 < len(method) <= MAX_METHOD_LEN:
        raise ProtocolViolation(f"method must be a string of 1-{MAX_METHOD_LEN} characters")
    if timeout_ms is not None and (
        type(timeout_ms) is not int or not 0 <= timeout_ms <= MAX_TIMEOUT_MS
    ):
        raise ProtocolViolation(f"timeout_ms must be null or an integer 0-{MAX_TIMEOUT_MS}")
    if type(kind) is not int or kind not in KIND_NAMES:
        raise ProtocolViolation(f"call kind must be one of {sorted(KIND_NAMES)}")
    timeout = None if timeout_ms is None else timeout_ms / 1000
    return Request(method, timeout, kind, arg)


def parse_frame(frame: object) -> tuple[int, object]:
    """Split a REPLY, ITEM, END or ERROR frame into (type, payload).

    For ERROR the payload is ``(code, message)``, both truncated to sane
    lengths.  Anything else raises ProtocolViolation.
    """
    if isinstance(frame, list) and frame:
        kind = frame[0]
        if kind in (REPLY, ITEM) and len(frame) == 2:
            return kind, frame[1]
        if kind == END and len(frame) == 1:
            return END, None
        if (
            kind == ERROR
            and len(frame) == 3
            and isinstance(frame[1], str)
            and isinstance(frame[2], str)
        ):
            return ERROR, (frame[1][:64], frame[2][:1024])
    raise ProtocolViolation(f"unexpected frame {str(frame)[:80]}")
