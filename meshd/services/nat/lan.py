"""LAN discovery: find peers on our LAN segment by multicast beacons, with no bootstrap node.

The trio shell over :mod:`nat.beacon`: one UDP socket bound to the beacon
group and port (shared with other nodes on this host, ``SO_REUSEPORT``),
joined on each private-network IPv4 interface we listen on.  It sends our
signed beacon out of each of them (1, 2, 4, ... s apart at start, then every
``[nat] lan_interval`` s) and dials the source address of each verified
beacon it hears, unless a direct connection to that peer is already up (a
relayed one is replaced, see ``Node._pick``).  Beacons come in through a
token bucket, dials at most once per peer and address per ``nat.beacon.RETRY``.
"""

from __future__ import annotations

import logging
import socket
import time

import trio

from nat.beacon import BEACON_SIZE, GROUP, PORT, LanPeers, decode_beacon, encode_beacon, next_delay
from nat.candidates import ip_literal, is_site_local
from nat.errors import Malformed
from nat.punch import DIAL_TIMEOUT

from ...identity import PeerId
from ...service import Host
from ...transport import DialError
from .interfaces import interface_addresses

log = logging.getLogger("meshd.lan")


class LanDiscovery:
    """Beacons out, dials in, for one node."""

    def __init__(self, host: Host, interval: float):
        self._host = host
        self._interval = interval
        self._peers = LanPeers()
        self._joined: set[str] = set()
        self.dials = 0  # dials started because of a beacon

    def interfaces(self) -> list[str]:
        """The IPv4 addresses to beacon on: our private-network interfaces if we listen on a
        wildcard address, our listen address if it is one of them, else none."""
        listen = self._host.listen_address.host
        candidates = interface_addresses() if listen in ("0.0.0.0", "::") else [listen]
        return [ip for ip in candidates if is_site_local(ip) and ip_literal(ip).version == 4]

    def status(self) -> dict:
        return {"interfaces": sorted(self._joined), "peers_heard": len(self._peers), "dials": self.dials}

    async def run(self) -> None:
        """Beacon and listen until cancelled (on the interfaces of the moment: one may come
        up later); returns at once if we listen on one address that is not a private one."""
        listen = self._host.listen_address.host
        if listen not in ("0.0.0.0", "::") and not self.interfaces():
            log.info("LAN discovery off: %s is not a private-network IPv4 address", listen)
            return
        with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if hasattr(socket, "SO_REUSEPORT"):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)  # never past the segment
            await sock.bind((GROUP, PORT))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._receive, sock)
                await self._send(sock)

    async def _send(self, sock) -> None:
        sent = 0
        while True:
            beacon = encode_beacon(self._host.peer_id.key, self._host.listen_address.port, time.time(),
                                   self._host.identity.sign)
            for ip in self.interfaces():
                try:
                    self._join(sock, ip)
                    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(ip))
                    await sock.sendto(beacon, (GROUP, PORT))
                except OSError as exc:  # the interface went away, or has no multicast
                    log.debug("LAN beacon on %s: %s", ip, exc)
            sent += 1
            await trio.sleep(next_delay(sent, self._interval))

    def _join(self, sock, ip: str) -> None:
        """Take the group's datagrams arriving on the interface with address ``ip`` (once)."""
        if ip not in self._joined:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                            socket.inet_aton(GROUP) + socket.inet_aton(ip))
            self._joined.add(ip)

    async def _receive(self, sock) -> None:
        while True:
            data, source = await sock.recvfrom(BEACON_SIZE + 1)
            if not self._peers.admit(trio.current_time()) or not is_site_local(source[0]):
                continue
            try:
                beacon = decode_beacon(data, time.time())
            except Malformed as exc:
                log.debug("LAN beacon from %s:%s dropped: %s", *source[:2], exc)
                continue
            peer = PeerId(beacon.key)
            if peer == self._host.peer_id:
                continue  # our own, looped back
            conn = self._host.live(peer)
            if conn is not None and conn.path != "relayed":
                continue
            if self._peers.heard(beacon.key, (source[0], beacon.port), trio.current_time()):
                self.dials += 1
                self._host.spawn(self._dial, peer, source[0], beacon.port)

    async def _dial(self, peer: PeerId, ip: str, port: int) -> None:
        try:
            await self._host.endpoint.dial(ip, port, peer, timeout=DIAL_TIMEOUT)
            log.info("found %s on the LAN at %s:%d", peer, ip, port)
        except DialError as exc:
            log.debug("LAN dial of %s at %s:%d: %s", peer, ip, port, exc)
