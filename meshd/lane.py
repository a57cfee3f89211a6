"""The bulk lane: chunks over TCP, keyed through the authenticated QUIC connection.

QUIC RPC moves ~250 MB/s (aioquic is pure Python); TCP moves GB/s.  So a
directly reachable peer also serves chunks over TCP, sealed with AES-256-GCM.
Any service can run a :class:`LaneServer` over its own chunks, under its own
token method (``shards.lane``, ``learning.lane``); the protocol:

1. Over QUIC the client calls the service's token method; the server answers ``{"port",
   "token", "nonce"}`` (32 and 16 random bytes), remembered for ``ctx.peer``,
   single-use, valid 30 s.
2. The client connects TCP to the peer's QUIC IP at ``port`` and sends 48
   bytes: the token's id ``SHA-256(ID_LABEL + token)`` and a 16-byte client
   nonce.  The server drops it unless that arrives within 5 s and names a live
   token; a token named is spent, whatever happens next.
3. Both derive ``HKDF-SHA256(ikm=token, salt=server nonce + client nonce,
   info=KEY_LABEL + client key + server key)``: 32 bytes of client->server
   key, then 32 of server->client key.
4. Frames: 4-byte big-endian length n, then n bytes sealed under the sender's
   key with nonce = 4 zero bytes + a 64-bit frame counter from 0, the length
   as associated data.  Server frame 0 is empty: "lane up".  Client frames
   are requests: msgpack lists of 1-256 32-byte ids (the server's
   ``max_ids``; a client sends at most its own).  The server answers each
   id in order with a frame of its bytes, or an empty frame: "not here" (the
   empty chunk, EMPTY_ID, is b"" either way).  Requests may be pipelined.

Why this authenticates the lane: QUIC authenticated both ends by their
Ed25519 keys and encrypts, so the token reaches only this server and the
caller it knows as ``ctx.peer``.  The token never crosses TCP, only a one-way
hash of it, so someone watching TCP cannot derive the keys; whoever seals or
opens a frame therefore knows the token: is that peer, or this server (and
the keys are bound to both identities).  A per-direction key and counter
nonces make a replayed, reordered, dropped, cut or altered frame fail to open,
and a spent token cannot open a second lane.  An attacker on the TCP path can
only deny service, which it could anyway; the caller then uses QUIC.  The
server bounds tokens and connections per peer and in all, and closes
connections that idle, stall or break the protocol.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Iterable, NamedTuple

import blake3
import msgpack
import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .address import plain_address
from .identity import PeerId
from .rpc import PermissionDenied, ResourceExhausted, RpcError, Unavailable
from .transport.endpoint import VIRTUAL_HOST

log = logging.getLogger("meshd.lane")

ID_LABEL, KEY_LABEL = b"meshd-lane/1 token id", b"meshd-lane/1 keys"
MAX_CHUNK = 4 << 20
MAX_IDS = 256
TAG = 16
EMPTY_ID = blake3.blake3(b"").digest()
_HELLO = 48
_PREFIX = bytes(4)

GetChunk = Callable[[bytes], "bytes | None | Awaitable[bytes | None]"]


class LaneError(Exception):
    """The lane broke: the peer closed it, a frame failed to open, or a limit or timeout hit."""


def _token_id(token: bytes) -> bytes:
    return hashlib.sha256(ID_LABEL + token).digest()


def _keys(token: bytes, snonce: bytes, cnonce: bytes, client: PeerId, server: PeerId) -> tuple[bytes, bytes]:
    """(client->server key, server->client key) for one lane."""
    okm = HKDF(hashes.SHA256(), 64, snonce + cnonce, KEY_LABEL + client.key + server.key).derive(token)
    return okm[:32], okm[32:]


async def _fill(stream: trio.SocketStream, view: memoryview, *, eof_ok: bool = False) -> memoryview | None:
    """Receive exactly ``len(view)`` bytes into ``view``, in reads as large as the kernel
    gives; None if the stream ends first with ``eof_ok`` and nothing read, else LaneError."""
    got, n = 0, len(view)
    while got < n:
        k = await stream.socket.recv_into(view[got:], n - got)
        if not k:
            if eof_ok and not got:
                return None
            raise LaneError("the peer closed the lane mid-frame")
        got += k
    return view


class _Framer:
    """One direction of one lane: seals or opens frames with a counter nonce (so never reused)."""

    def __init__(self, stream: trio.SocketStream, key: bytes, max_frame: int):
        self.stream, self.aead, self.max_frame, self.count = stream, AESGCM(key), max_frame, 0
        self.buf = memoryview(bytearray(0))
        self.opened = memoryview(bytearray(0))  # where borrowed frames are opened into

    def _nonce(self) -> bytes:
        self.count += 1
        return _PREFIX + (self.count - 1).to_bytes(8, "big")

    def _room(self, n: int) -> memoryview:
        if len(self.buf) < n:  # grown once to the largest frame seen, then reused
            self.buf = memoryview(bytearray(max(n, min(len(self.buf) * 2, self.max_frame + 4))))
        return self.buf[:n]

    async def send(self, payload: bytes | memoryview) -> None:
        """Seal ``payload`` as the next frame and write it (one copy: the cipher's output)."""
        n = len(payload) + TAG
        out = self._room(4 + n)
        out[:4] = header = n.to_bytes(4, "big")
        self.aead.encrypt_into(self._nonce(), payload, header, out[4:])
        await self.stream.send_all(out)

    async def receive(self, *, borrow: bool = False,
                      into: Callable[[int], memoryview | None] | None = None) -> bytes | memoryview | None:
        """The next frame's payload (with ``borrow``, a view of a buffer the next
        call reuses); None at a clean end of stream.  ``into(n)``, once the whole
        frame is here, may give a writable view of exactly ``n`` bytes to open a
        payload of ``n`` bytes into (then returned; None: as without it).  Raises
        LaneError for a frame over the limit or one that does not open (tampered,
        replayed, reordered; what was written to ``into``'s view is then garbage)."""
        head = await _fill(self.stream, self._room(4), eof_ok=True)
        if head is None:
            return None
        header = bytes(head)
        n = int.from_bytes(header, "big")
        if not TAG <= n <= self.max_frame:
            raise LaneError(f"frame of {n} bytes")
        body = await _fill(self.stream, self._room(n))
        try:
            out = into(n - TAG) if into is not None and n > TAG else None
            if out is not None:
                if len(out) != n - TAG:
                    raise ValueError(f"into gave {len(out)} bytes for {n - TAG}")
            elif not borrow:
                return self.aead.decrypt(self._nonce(), body, header)
            else:
                if len(self.opened) < n - TAG:
                    self.opened = memoryview(bytearray(self.max_frame - TAG))
                out = self.opened[:n - TAG]
            self.aead.decrypt_into(self._nonce(), body, header, out)
            return out
        except InvalidTag:
            raise LaneError("a frame failed authentication") from None


class _Token(NamedTuple):
    peer: PeerId
    token: bytes
    nonce: bytes
    expires: float


def _drop(counts: Counter, key) -> None:
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]


def _max_request(max_ids: int) -> int:
    """Bytes of a sealed request of ``max_ids`` ids: 3 bytes per bin8 id + an array header."""
    return max_ids * 35 + 16 + TAG


_MAX_REQUEST = _max_request(MAX_IDS)


def _parse_request(payload: bytes, max_ids: int = MAX_IDS) -> list[bytes]:
    ids = msgpack.unpackb(payload, max_array_len=max_ids, max_bin_len=32, max_str_len=0,
                          max_map_len=0, max_ext_len=0)
    if not (isinstance(ids, list) and 0 < len(ids) <= max_ids
            and all(isinstance(cid, bytes) and len(cid) == 32 for cid in ids)):
        raise ValueError(f"a request is a list of 1-{max_ids} 32-byte ids")
    return ids


@dataclass
class LaneConfig:
    """The ``[lane]`` section: what one node's bulk lanes (shard sync's and training's) grant
    strangers; each service's lane takes its own share of these."""

    # seconds a token waits for its connection
    token_ttl: float = field(default=30.0, metadata={"above": 0, "max": 3600.0})
    tokens_per_peer: int = field(default=8, metadata={"min": 1, "max": 1 << 16})  # tokens one peer holds unused
    max_tokens: int = field(default=1024, metadata={"min": 1, "max": 1 << 20})  # ... all peers together
    conns_per_peer: int = field(default=4, metadata={"min": 1, "max": 1 << 16})  # lanes open to one peer
    max_conns: int = field(default=32, metadata={"min": 1, "max": 1 << 16})  # ... to all, handshaking ones included
    handshake_timeout: float = field(default=5.0, metadata={"above": 0, "max": 600.0})  # a lane's key exchange
    idle_timeout: float = field(default=60.0, metadata={"above": 0, "max": 86400.0})  # a lane with no request closes


class LaneServer:
    """Serves ``get_chunk(id)`` to peers over TCP lanes.  ``get_chunk`` returns bytes or
    None, or an awaitable of either: a plain function runs on the trio thread, so one
    that reads disk should be async (e.g. ``trio.to_thread.run_sync`` inside).  Chunks
    over ``max_chunk`` bytes are served as "not here"; a request of more than ``max_ids``
    ids closes its lane.  With ``read_ahead`` = n, a lane
    gets up to n chunks ahead of the one it is sending (so reading one overlaps sealing
    and sending the last); with 0, each is got only once the one before was sent (what
    a ``get_chunk`` that counts what was sent, or returns views it may reuse, needs)."""

    def __init__(self, node, get_chunk: GetChunk, *, host: str | None = None, max_chunk: int = MAX_CHUNK,
                 limits: LaneConfig = LaneConfig(), read_ahead: int = 0, max_ids: int = MAX_IDS,
                 clock: Callable[[], float] = trio.current_time):
        self.node, self.get_chunk, self.host = node, get_chunk, host
        self.max_chunk, self.limits, self.clock = max_chunk, limits, clock
        self.read_ahead, self.max_ids = read_ahead, max_ids
        self.port: int | None = None
        self._tokens: dict[bytes, _Token] = {}  # by token id
        self._peer_tokens: Counter[PeerId] = Counter()
        self._peer_conns: Counter[PeerId] = Counter()
        self._conns = 0  # including those still in their handshake
        self._handshakes = 0  # connections that have not named a token yet: at most one per token

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host`` (by default the node's listen host), port 0 (then
        ``self.port``); serve until cancelled.
        Peers ask for a token with the service's token method, which :meth:`issue` answers."""
        bind = self.host if self.host is not None else self.node.listen_address.host
        family, kind, proto, _, addr = (await trio.socket.getaddrinfo(bind, 0, type=trio.socket.SOCK_STREAM))[0]
        sock = trio.socket.socket(family, kind, proto)
        if family == trio.socket.AF_INET6 and addr[0] == "::":
            sock.setsockopt(trio.socket.IPPROTO_IPV6, trio.socket.IPV6_V6ONLY, 0)
        await sock.bind(addr)
        sock.listen(128)
        self.port = sock.getsockname()[1]
        listener = trio.SocketListener(sock)
        try:
            async with listener:
                task_status.started()
                await trio.serve_listeners(self._handle, [listener])
        finally:
            self.port = None

    async def issue(self, arg: object, ctx) -> dict:
        """The token method: a fresh single-use token for the authenticated caller
        (UNAVAILABLE while the lane does not listen)."""
        if self.port is None:
            raise Unavailable("the lane is not listening")
        peer = ctx.peer
        if not isinstance(peer, PeerId):
            raise PermissionDenied("lanes are for authenticated peers")
        now = self.clock()
        for tid, tok in [item for item in self._tokens.items() if item[1].expires <= now]:
            self._spend(tid)
        limits = self.limits
        if (self._peer_tokens[peer] >= limits.tokens_per_peer or len(self._tokens) >= limits.max_tokens
                or self._peer_conns[peer] >= limits.conns_per_peer or self._conns >= limits.max_conns):
            raise ResourceExhausted("too many lanes or lane tokens")
        tok = _Token(peer, os.urandom(32), os.urandom(16), now + limits.token_ttl)
        self._tokens[_token_id(tok.token)] = tok
        self._peer_tokens[peer] += 1
        return {"port": self.port, "token": tok.token, "nonce": tok.nonce}

    def _spend(self, tid: bytes) -> _Token | None:
        tok = self._tokens.pop(tid, None)
        if tok is not None:
            _drop(self._peer_tokens, tok.peer)
        return tok

    async def _handle(self, stream: trio.SocketStream) -> None:
        """One TCP connection: hello, then requests until the client leaves or misbehaves."""
        if self._conns >= self.limits.max_conns or self._handshakes >= len(self._tokens):
            await trio.aclose_forcefully(stream)  # no token waits for this connection
            return
        self._conns += 1
        peer = None
        try:
            self._handshakes += 1
            try:
                with trio.fail_after(self.limits.handshake_timeout):
                    raw = await _fill(stream, memoryview(bytearray(_HELLO)))
            finally:
                self._handshakes -= 1
            tok = self._spend(bytes(raw[:32]))
            if tok is None or tok.expires <= self.clock() or self._peer_conns[tok.peer] >= self.limits.conns_per_peer:
                raise LaneError("no such token, or expired, or too many lanes")
            peer = tok.peer
            self._peer_conns[peer] += 1
            c2s, s2c = _keys(tok.token, tok.nonce, bytes(raw[32:]), peer, self.node.peer_id)
            rx, tx = _Framer(stream, c2s, _max_request(self.max_ids)), _Framer(stream, s2c, self.max_chunk + TAG)
            await tx.send(b"")
            await self._serve(rx, tx)
        except* (LaneError, ValueError, msgpack.UnpackException, trio.TooSlowError,
                 trio.BrokenResourceError, trio.ClosedResourceError, OSError) as group:
            log.debug("lane from %s closed: %r", peer, group.exceptions[0])
        except* Exception:  # a bug here must not take the node down
            log.warning("lane from %s failed", peer, exc_info=True)
        finally:
            self._conns -= 1
            if peer is not None:
                _drop(self._peer_conns, peer)
            await trio.aclose_forcefully(stream)

    async def _serve(self, rx: _Framer, tx: _Framer) -> None:
        """Read requests (up to 4 queued) while answering earlier ones, getting up to
        ``read_ahead`` chunks ahead of the one being sent.  Ends when the client closes,
        or nothing was asked or sent for ``idle_timeout`` s."""
        send, queue = trio.open_memory_channel[list](4)
        ready_send, ready = trio.open_memory_channel[tuple](math.inf)
        unsent = trio.Semaphore(1 + self.read_ahead)  # chunks got and not yet sent, at most
        pending, last = 0, trio.current_time()

        async def get() -> None:
            async with ready_send:
                async for ids in queue:
                    for i, cid in enumerate(ids):
                        await unsent.acquire()
                        try:
                            data = self.get_chunk(cid)
                            if inspect.isawaitable(data):
                                data = await data
                        except Exception as exc:  # our store's trouble, not the peer's
                            log.warning("get_chunk(%s) failed: %r", cid.hex()[:16], exc)
                            data = None
                        if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) > self.max_chunk:
                            data = b""
                        await ready_send.send((data, i == len(ids) - 1))

        async def answer() -> None:
            nonlocal pending, last
            async for data, last_of_request in ready:
                with trio.fail_after(self.limits.idle_timeout):  # a client that stops reading
                    await tx.send(data)
                unsent.release()
                last = trio.current_time()
                pending -= last_of_request

        async def watchdog() -> None:
            idle = self.limits.idle_timeout
            while pending or trio.current_time() < last + idle:
                await (trio.sleep(idle / 4) if pending else trio.sleep_until(last + idle))
            nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(get)
            nursery.start_soon(answer)
            nursery.start_soon(watchdog)
            while (payload := await rx.receive()) is not None:
                ids = _parse_request(payload, self.max_ids)
                pending, last = pending + 1, trio.current_time()
                await send.send(ids)
            nursery.cancel_scope.cancel()  # the client left


class Lane:
    """A client's open lane to one peer; ``fetch`` chunks, then ``aclose`` (or ``async with``)."""

    def __init__(self, stream: trio.SocketStream, rx: _Framer, tx: _Framer, *,
                 window: int = 2, read_timeout: float = 30.0, max_ids: int = MAX_IDS):
        self._stream, self._rx, self._tx = stream, rx, tx
        self.window, self.read_timeout, self.max_ids = window, read_timeout, max_ids
        self._busy = self._broken = False

    async def fetch(self, ids: Iterable[bytes], *, borrow: bool = False,
                    into: Callable[[bytes, int], memoryview | None] | None = None,
                    ) -> AsyncIterator[tuple[bytes, bytes | memoryview | None]]:
        """Yield ``(id, bytes or None)`` for each of ``ids`` in order; None: the peer
        lacks it.  Bytes are NOT checked against the id: the caller hashes them.
        With ``borrow`` each chunk is a view that the next one overwrites (no
        allocation per chunk: the caller copies what it keeps).  ``into(id, n)``
        may give where to open a chunk of ``n`` bytes (a writable view of exactly
        ``n`` bytes, e.g. its place in the tensor it belongs to: no allocation and
        no copy; None: as without it); the chunk yielded is then that view.
        Requests go out ``window`` batches of ``max_ids`` (256) ahead, so the server never idles.
        Raises LaneError (the lane is then closed) if the lane breaks or a frame
        fails authentication: nothing unauthenticated is ever yielded.  Leaving
        the loop before the last item closes the lane (once the generator is
        closed: ``contextlib.aclosing`` makes that prompt).  One fetch at a time."""
        ids = list(ids)
        if not all(isinstance(cid, bytes) and len(cid) == 32 for cid in ids):
            raise ValueError("chunk ids are 32 bytes")
        if self._busy or self._broken:
            raise LaneError("lane busy or closed")
        if not ids:
            return
        self._busy, left = True, len(ids)
        batches = [ids[i:i + self.max_ids] for i in range(0, len(ids), self.max_ids)]
        sent = 0
        try:
            for i, batch in enumerate(batches):
                while sent < min(len(batches), i + self.window):
                    await self._tx.send(msgpack.packb(batches[sent]))
                    sent += 1
                for cid in batch:
                    with trio.fail_after(self.read_timeout):
                        data = await self._rx.receive(
                            borrow=borrow, into=None if into is None else functools.partial(into, cid))
                    if data is None:
                        raise LaneError("the peer closed the lane")
                    left -= 1
                    self._busy = left > 0  # free once the last answer is in
                    yield cid, (data if data or cid == EMPTY_ID else None)
        except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise LaneError(f"lane broke: {exc!r}") from None
        finally:
            if left:  # mid-stream: answers still in flight would be misread
                self._busy, self._broken = False, True
                self._stream.socket.close()

    async def aclose(self) -> None:
        """Close the TCP connection (idempotent)."""
        self._broken = True
        await trio.aclose_forcefully(self._stream)

    async def __aenter__(self) -> Lane:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


async def open_lane(node, peer: PeerId, *, method: str, timeout: float = 10,
                    max_chunk: int = MAX_CHUNK, max_ids: int = MAX_IDS) -> Lane | None:
    """A lane to ``peer``'s server whose tokens RPC ``method`` issues, or None (use
    QUIC) when: no live QUIC connection to it, or only a relayed or hole-punched one
    (its NAT would not let TCP in); ``method``
    fails (e.g. UNKNOWN_METHOD: the peer serves no lane; RESOURCE_EXHAUSTED); or the
    TCP connection or its handshake fails, all within ``timeout`` seconds.  The lane
    takes chunks of at most ``max_chunk`` bytes and asks for ``max_ids`` at a time."""
    conn = node.live(peer)
    if conn is None or conn.remote_addr[0] == VIRTUAL_HOST or conn.path != "direct":
        return None
    host = plain_address(conn.remote_addr)[0]
    stream = None
    with trio.move_on_after(timeout):
        try:
            reply = await node.rpc.call(peer, method, None, timeout=timeout)
            port, token, snonce = reply["port"], reply["token"], reply["nonce"]
            if not (type(port) is int and 0 < port < 65536 and isinstance(token, bytes)
                    and len(token) == 32 and isinstance(snonce, bytes) and len(snonce) == 16):
                raise LaneError(f"bad {method} reply")
            stream = await trio.open_tcp_stream(host, port)
            cnonce = os.urandom(16)
            c2s, s2c = _keys(token, snonce, cnonce, node.peer_id, peer)
            await stream.send_all(_token_id(token) + cnonce)
            rx, tx = _Framer(stream, s2c, max_chunk + TAG), _Framer(stream, c2s, _max_request(max_ids))
            if await rx.receive() != b"":
                raise LaneError("no lane handshake")
            return Lane(stream, rx, tx, max_ids=max_ids)
        except (RpcError, LaneError, OSError, KeyError, TypeError, trio.BrokenResourceError) as exc:
            log.debug("no lane to %s: %r", peer, exc)
    if stream is not None:
        await trio.aclose_forcefully(stream)
    return None
