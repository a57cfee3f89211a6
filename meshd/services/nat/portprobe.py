"""Port-prediction probing: a symmetric NAT meeting an endpoint-independent one.

Plain hole punching fails here: the symmetric ("hard") side gets a new,
unpredictable public port for every destination.  The method Tailscale
describes wins by numbers instead:

* the hard side opens ``HARD_PORTS`` extra UDP sockets and sends one packet
  from each to the easy side's public address, so its NAT holds that many
  mappings that accept packets from the easy side;
* the easy side sends ``EASY_PROBES`` packets from its QUIC socket to random
  ports of the hard side's public IP; each opens the easy NAT's filter for
  that port and lands on one of the hard side's mappings with probability
  HARD_PORTS / 64512, so at least one lands with probability
  1 - (1 - 256/64512)^2048, about 99.97 % (2048 probes take ~0.2 s);
* the first extra socket that hears from the easy side wins: the hard side
  dials QUIC through it (a virtual path labelled "punched", see
  ``Endpoint.attach_path``) and closes the others.

Everything is bounded (sockets, probes, seconds); when it does not work out
the relayed connection stays.  Roles, admission, the numbers and the probe
schedule are :mod:`nat.portprobe`'s; this module does the I/O.
"""

from __future__ import annotations

import logging
import random
import socket
import trio

from nat.behaviour import Mapping
from nat.portprobe import (DIAL_TIMEOUT, HARD_PORTS, HIT_WAIT, ProbeAdmission, parse_open_ports,
                           parse_probe, probe_batches, probe_ports, role)
from nat.stun import binding_request

from ...address import HostPort
from ...identity import PeerId
from ...rpc import RpcError
from ...service import Host
from ...transport import DialError, PeerConnection, set_when_terminated
from .errors import parse_hostport, rpc_errors
from .stun import NodeStun

log = logging.getLogger("meshd.portprobe")


class PortProber:
    """Both sides of port-prediction probing on one node."""

    def __init__(self, host: Host, stun: NodeStun, rng: random.Random | None = None):
        self._node = host
        self._stun = stun
        self._rng = rng or random.Random()
        self._admission = ProbeAdmission()

    def rpc_methods(self) -> dict:
        return {"punch.open_ports": self._serve_open_ports, "punch.probe": self._serve_probe}

    def _admit(self, ctx) -> None:
        """Serve only peers we reach through a relay, once per ``ASK_INTERVAL`` each."""
        with rpc_errors():
            self._admission.admit(ctx.peer, ctx.info.get("path"), trio.current_time())

    def my_mapping(self) -> Mapping:
        report = self._stun.mapping
        return report.mapping if report else Mapping.UNKNOWN

    def my_public(self) -> HostPort | None:
        report = self._stun.mapping
        if report is None or not report.public_addresses:
            return None
        return HostPort(*report.public_addresses[0])

    async def run(self, peer: PeerId, theirs: Mapping, their_public: HostPort) -> PeerConnection | None:
        """Try probing with ``peer`` (reached over a relay); the direct connection, or None."""
        mine, my_public = self.my_mapping(), self.my_public()
        if my_public is None:
            return None
        side = role(mine, theirs)
        if side == "hard":
            sockets = self._open_ports(their_public)
            try:
                await self._node.rpc.call(peer, "punch.probe", {"ip": my_public.host}, timeout=10)
            except RpcError as exc:
                _close(sockets)
                log.info("port probing with %s: %s", peer, exc)
                return None
            return await self._dial_on_hit(peer, sockets, their_public)
        if side == "easy":
            try:
                await self._node.rpc.call(peer, "punch.open_ports", {"addr": str(my_public)}, timeout=10)
            except RpcError as exc:
                log.info("port probing with %s: %s", peer, exc)
                return None
            await self._probe(their_public.host)
            return await self._wait_for_direct(peer)
        return None

    # --- hard side -------------------------------------------------------------

    async def _serve_open_ports(self, arg: object, ctx) -> None:
        self._admit(ctx)
        with rpc_errors():
            easy = parse_hostport(parse_open_ports(arg))
        sockets = self._open_ports(easy)  # before we answer: the probes come right after
        self._node.spawn(self._dial_on_hit, ctx.peer, sockets, easy)

    def _open_ports(self, easy: HostPort) -> list[socket.socket]:
        """``HARD_PORTS`` sockets, each having sent one packet to ``easy`` (a NAT mapping each)."""
        family = self._node.endpoint.family
        sockets = []
        for _ in range(HARD_PORTS):
            sock = socket.socket(family, socket.SOCK_DGRAM)
            sock.setblocking(False)
            sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
            try:
                sock.sendto(binding_request().encode(), (easy.host, easy.port))
            except OSError:
                pass
            sockets.append(sock)
        return sockets

    async def _dial_on_hit(self, peer: PeerId, sockets: list[socket.socket],
                           easy: HostPort) -> PeerConnection | None:
        """Wait for the easy side's probe on any socket, then dial QUIC through that one."""
        winner: list[socket.socket] = []
        with trio.move_on_after(HIT_WAIT):
            async with trio.open_nursery() as nursery:
                for sock in sockets:
                    nursery.start_soon(_listen_for, sock, easy, winner, nursery.cancel_scope)
        _close([s for s in sockets if s not in winner])
        if not winner:
            log.info("port probing with %s: no probe arrived", peer)
            return None
        return await self._dial_through(peer, winner[0], easy)

    async def _dial_through(self, peer: PeerId, sock: socket.socket, easy: HostPort) -> PeerConnection | None:
        endpoint = self._node.endpoint
        target = (easy.host, easy.port)
        addr = endpoint.attach_path(lambda data: _send(sock, data, target), label="punched")
        done = trio.Event()
        self._node.spawn(_carry, endpoint, sock, target, addr, done)
        try:
            conn = await endpoint.dial_path(addr, peer, DIAL_TIMEOUT, f"{peer} by port probing")
        except DialError as exc:
            log.info("port probing with %s: %s", peer, exc)
            done.set()
            return None
        self._node.spawn(set_when_terminated, conn, done)
        log.info("port probing reached %s through local port %d", peer, sock.getsockname()[1])
        return conn

    # --- easy side -------------------------------------------------------------

    async def _serve_probe(self, arg: object, ctx) -> None:
        self._admit(ctx)
        with rpc_errors():
            ip = parse_probe(arg)
        self._node.spawn(self._probe, ip)

    async def _probe(self, ip: str) -> None:
        """``EASY_PROBES`` packets from our QUIC socket to random ports of ``ip``."""
        endpoint = self._node.endpoint
        try:
            target_ip = (await endpoint.resolve(ip, 1))[0]
        except DialError:
            return
        for ports, gap in probe_batches(probe_ports(self._rng)):
            for port in ports:
                endpoint.send_datagram(binding_request().encode(), (target_ip, port))
            await trio.sleep(gap)

    async def _wait_for_direct(self, peer: PeerId) -> PeerConnection | None:
        with trio.move_on_after(HIT_WAIT + DIAL_TIMEOUT):
            while True:
                conn = self._node.live(peer)
                if conn is not None and conn.path == "punched":
                    return conn
                await self._node.wait_connection_change(peer)
        return None


async def _listen_for(sock: socket.socket, easy: HostPort, winner: list, scope: trio.CancelScope) -> None:
    while True:
        await trio.lowlevel.wait_readable(sock)
        try:
            _, source = sock.recvfrom(2048)
        except OSError:
            continue
        if source[0] == easy.host and source[1] == easy.port:
            winner.append(sock)
            scope.cancel()
            return


async def _carry(endpoint, sock: socket.socket, target: tuple, addr: tuple, done: trio.Event) -> None:
    """Feed what ``target`` sends to ``sock`` into the endpoint, until ``done``."""
    with trio.CancelScope() as scope:
        async def stop() -> None:
            await done.wait()
            scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop)
            while True:
                await trio.lowlevel.wait_readable(sock)
                try:
                    data, source = sock.recvfrom(65536)
                except OSError:
                    continue
                if source[:2] == target:
                    endpoint.path_datagram_received(data, addr)
    endpoint.detach_path(addr)
    sock.close()


def _send(sock: socket.socket, data: bytes, target: tuple) -> None:
    try:
        sock.sendto(data, target)
    except OSError:
        pass  # a full buffer drops the datagram, as UDP does


def _close(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()
