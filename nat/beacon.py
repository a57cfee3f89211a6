"""LAN discovery beacons, with no I/O: peers on one LAN find each other without a bootstrap node.

A node sends a small signed datagram to an IPv4 multicast group on each of
its private-network interfaces (TTL 1, so it never leaves the segment): "the
owner of this Ed25519 key listens for QUIC on port P of the address this
datagram came from, as of time T".  A node that hears one dials that source
address and port expecting that key's PeerId; the QUIC handshake then proves
it.  So a stranger on the LAN can cause at most a dial, and only at the rate
:class:`LanPeers` admits.

Wire format (:data:`BEACON_SIZE` bytes, fixed; big-endian)::

    "MESHDLAN" | version 1 (1 byte) | public key (32) | QUIC port (2) | sent at, ms since the epoch (8)
    | Ed25519 signature (64) over "meshd-lan-beacon/1" + everything before it

A fixed layout rather than msgpack or DNS-SD: every field is checked by its
length alone, and nothing in a 115-byte datagram needs a parser.  The
signature binds the port and time to the key, and a beacon more than
:data:`FRESH` seconds from our clock is refused, so an old one cannot be
replayed for long.
"""

from __future__ import annotations

import random
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from nacl.bindings import crypto_sign_open
from nacl.exceptions import CryptoError

from .errors import Malformed

GROUP = "239.255.77.77"  # IPv4 organization-local scope (RFC 2365); sent with TTL 1
PORT = 4199
MAGIC = b"MESHDLAN"
VERSION = 1
CONTEXT = b"meshd-lan-beacon/1"
_BODY = struct.Struct("!8sB32sHQ")
BEACON_SIZE = _BODY.size + 64
FRESH = 120.0  # seconds a beacon's time may differ from ours (clocks of one LAN roughly agree)
INTERVAL = 30.0  # seconds between beacons once the start-up ones are sent
RETRY = 30.0  # seconds before a peer heard again at the same address is dialed again
MAX_PEERS = 256  # peers remembered (least recently heard forgotten first)
RATE = 20.0  # beacons per second taken in on average (the rest are dropped unread) ...
BURST = 40  # ... and at most this many at once


@dataclass(frozen=True)
class Beacon:
    """A verified beacon: whose key, which QUIC port, sent when (seconds since the epoch)."""

    key: bytes
    port: int
    sent_at: float


def encode_beacon(key: bytes, port: int, now: float, sign: Callable[[bytes], bytes]) -> bytes:
    """The beacon for ``key`` listening on ``port`` at wall-clock time ``now``, signed by ``sign``."""
    body = _BODY.pack(MAGIC, VERSION, key, port, int(now * 1000))
    return body + sign(CONTEXT + body)


def decode_beacon(data: bytes, now: float) -> Beacon:
    """The beacon in ``data``, checked: size, magic and version, a port, fresh, a valid signature.

    Raises Malformed saying which check failed.  The signature, the only
    costly check, is verified last.
    """
    if len(data) != BEACON_SIZE:
        raise Malformed(f"a beacon is {BEACON_SIZE} bytes, not {len(data)}")
    magic, version, key, port, sent_ms = _BODY.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise Malformed("not a meshd beacon of version 1")
    if port == 0:
        raise Malformed("beacon names port 0")
    if abs(sent_ms / 1000 - now) > FRESH:
        raise Malformed(f"beacon sent {sent_ms / 1000 - now:+.0f} s from our clock")
    try:  # libsodium: signature, then the signed bytes, as one string
        crypto_sign_open(data[_BODY.size:] + CONTEXT + data[:_BODY.size], key)
    except CryptoError:
        raise Malformed("bad beacon signature") from None
    return Beacon(key, port, sent_ms / 1000)


def next_delay(sent: int, interval: float = INTERVAL, rng: random.Random | None = None) -> float:
    """Seconds to wait after the ``sent``-th beacon (1, 2, ...) before the next one.

    1, 2, 4, ... seconds at start, so a peer that missed the first beacon
    hears one soon (as mDNS announces, RFC 6762 section 8.3), then every
    ``interval`` seconds with 10 % jitter, so the nodes of one LAN do not send
    in step.
    """
    delay = 2.0 ** (sent - 1)
    if delay < interval:
        return delay
    return interval * (rng or random).uniform(0.9, 1.1)


class LanPeers:
    """What discovery remembers of the peers it heard, in bounded memory.

    :meth:`admit` rate-limits datagrams before they are decoded (a token
    bucket of :data:`RATE` per second, :data:`BURST` deep); :meth:`heard`
    says whether a verified beacon should be dialed: yes for a peer not
    dialed in the last :data:`RETRY` seconds or now at another address.
    At most :data:`MAX_PEERS` peers are remembered.
    """

    def __init__(self, *, max_peers: int = MAX_PEERS, rate: float = RATE, burst: int = BURST,
                 retry: float = RETRY):
        self.max_peers = max_peers
        self.rate = rate
        self.burst = burst
        self.retry = retry
        self._tokens = float(burst)
        self._filled_at: float | None = None
        self._dialed: OrderedDict[bytes, tuple[tuple[str, int], float]] = OrderedDict()

    def admit(self, now: float) -> bool:
        """Whether one more datagram may be read at ``now`` (takes a token if so)."""
        if self._filled_at is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._filled_at) * self.rate)
        self._filled_at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def heard(self, key: bytes, address: tuple[str, int], now: float) -> bool:
        """Note a verified beacon of ``key`` from ``address``; True if it should be dialed now."""
        last = self._dialed.get(key)
        if last is not None and last[0] == address and now - last[1] < self.retry:
            self._dialed.move_to_end(key)
            return False
        self._dialed[key] = (address, now)
        self._dialed.move_to_end(key)
        while len(self._dialed) > self.max_peers:
            self._dialed.popitem(last=False)
        return True

    def __len__(self) -> int:
        return len(self._dialed)
