"""The small part of HTTP/1.1 a UPnP client needs, with no I/O.

Requests are built with ``Connection: close``, so an answer is everything
the gateway sends until it closes; :func:`parse_response` takes those bytes
and returns the status and body, with the body framed by Content-Length,
chunked transfer coding, or the end of the data.  URLs are checked by
:func:`gateway_url`: plain ``http``, an IP literal host that is the gateway
itself, no user info.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from .errors import Malformed

MAX_HEADER_SIZE = 8 * 1024


@dataclass(frozen=True)
class Url:
    """An ``http://HOST:PORT/PATH`` URL on the gateway."""

    host: str
    port: int
    path: str  # with the query, if any; at least "/"

    def __str__(self) -> str:
        return f"http://{self.host}:{self.port}{self.path}"


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes


def gateway_url(text: str, gateway: str) -> Url:
    """``text`` as a :class:`Url` on ``gateway``, or Malformed: only plain http to
    the gateway's own IP address is accepted (a description or control URL that
    points elsewhere would have us send requests to a host the gateway chose)."""
    try:
        parts = urlsplit(text.strip())
        port = parts.port or 80
        host = parts.hostname or ""
    except ValueError as exc:
        raise Malformed(f"URL {text!r}: {exc}") from None
    if parts.scheme != "http" or parts.username is not None or parts.password is not None:
        raise Malformed(f"URL {text!r}: only plain http://HOST:PORT/ URLs are followed")
    try:
        same = ipaddress.ip_address(host) == ipaddress.ip_address(gateway)
    except ValueError:
        raise Malformed(f"URL {text!r}: the host must be the gateway's IP address") from None
    if not same:
        raise Malformed(f"URL {text!r} points away from the gateway {gateway}")
    path = parts.path or "/"
    return Url(gateway, port, path + (f"?{parts.query}" if parts.query else ""))


def request(method: str, url: Url, headers: list[tuple[str, str]] = (), body: bytes = b"") -> bytes:
    """An HTTP/1.1 request for ``url`` that asks the server to close after answering."""
    for name, value in headers:
        if any(c in name + value for c in "\r\n"):
            raise ValueError(f"header {name!r} holds a line break")
    lines = [f"{method} {url.path} HTTP/1.1", f"Host: {url.host}:{url.port}", "Connection: close",
             *(f"{name}: {value}" for name, value in headers)]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body


def parse_response(data: bytes) -> Response:
    """The status and body of a complete answer (all bytes up to the close).

    Malformed if the status line or headers are broken, the headers exceed
    :data:`MAX_HEADER_SIZE`, or the body is shorter than its framing says.
    """
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        raise Malformed("an HTTP answer without the end of its headers" if len(data) <= MAX_HEADER_SIZE
                        else "HTTP headers too long")
    if len(head) > MAX_HEADER_SIZE:
        raise Malformed("HTTP headers too long")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = _status(status_line)
    headers = parse_headers(header_lines)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return Response(status, _dechunk(rest))
    if "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError:
            raise Malformed(f"Content-Length {headers['content-length']!r}") from None
        if length < 0 or len(rest) < length:
            raise Malformed(f"an HTTP body of {len(rest)} bytes where Content-Length says {length}")
        return Response(status, rest[:length])
    return Response(status, rest)


def _status(line: str) -> int:
    version, _, rest = line.partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit() or len(code) != 3:
        raise Malformed(f"HTTP status line {line[:80]!r}")
    return int(code)


def parse_headers(lines: list[str]) -> dict[str, str]:
    """``Name: value`` lines as a dict with lower-case names (the last of a repeated
    name wins); Malformed for a line without a name and colon."""
    headers = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise Malformed(f"HTTP header line {line[:80]!r}")
        headers[name.lower()] = value.strip()
    return headers


def _dechunk(data: bytes) -> bytes:
    """The body of a chunked transfer coding (chunk extensions and trailers ignored)."""
    body = bytearray()
    while True:
        size_line, sep, data = data.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0].strip(), 16)
        except ValueError:
            raise Malformed(f"HTTP chunk size {size_line[:20]!r}") from None
        if not sep or size < 0:
            raise Malformed("a truncated HTTP chunk")
        if size == 0:
            return bytes(body)
        if len(data) < size + 2 or data[size:size + 2] != b"\r\n":
            raise Malformed("a truncated HTTP chunk")
        body += data[:size]
        data = data[size + 2:]
