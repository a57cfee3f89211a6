"""PCP (RFC 6887) with NAT-PMP (RFC 6886) fallback on the gateway's port 5351.

One client for the two protocols that share the port: it asks in PCP and,
when the gateway answers "unsupported version" (a NAT-PMP-only gateway, or
an older PCP), in NAT-PMP from then on (RFC 6887 appendix A).  Either can be
left out.  Requests are retransmitted at 0.25, 0.5, 1 and 2 s (RFC 6886's
schedule cut short; RFC 6887's 3 s first wait is meant for clients with
many mappings, this one asks once at start and at each renewal), so a
silent gateway costs 3.75 s and one without the service (ICMP port
unreachable) nothing.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import TypeVar

import trio

from nat import natpmp, pcp
from nat.errors import Malformed

from ...address import HostPort
from .mapping import Lease, PortMapError, local_address_toward

log = logging.getLogger("meshd.portmap")

TRIES = 4
FIRST_WAIT = 0.25
T = TypeVar("T")


class PcpClient:
    """A UDP mapping of ``port`` on ``gateway`` by PCP and/or NAT-PMP (``name`` says which answered)."""

    def __init__(self, gateway: str, port: int, *, use_pcp: bool = True, use_natpmp: bool = True):
        if not (use_pcp or use_natpmp):
            raise ValueError("choose PCP, NAT-PMP or both")
        self._gateway = gateway
        self._port = port
        self.name = "pcp" if use_pcp else "natpmp"
        self._fallback = use_pcp and use_natpmp
        self._request: pcp.MapRequest | None = None  # the PCP mapping (its nonce renews it)
        self._epoch = pcp.Epoch()

    async def map(self, lifetime: int) -> Lease:
        if self.name == "pcp":
            try:
                return await self._map_pcp(lifetime)
            except pcp.UnsupportedVersion as exc:
                if not self._fallback:
                    raise PortMapError(f"{self._gateway} does not speak PCP (version {exc.version})") from None
                log.info("%s speaks NAT-PMP, not PCP", self._gateway)
                self.name = "natpmp"
        return await self._map_natpmp(lifetime)

    async def unmap(self) -> None:
        try:
            if self.name == "pcp" and self._request is not None:
                await self._exchange(self._request.encode(0), self._parse_pcp)
            elif self.name == "natpmp":
                await self._exchange(natpmp.map_udp_request(self._port, 0, 0), natpmp.parse_map_udp)
        except (pcp.PcpError, natpmp.NatPmpError) as exc:
            raise PortMapError(str(exc)) from None

    # --- the two protocols ------------------------------------------------------------

    async def _map_pcp(self, lifetime: int) -> Lease:
        if self._request is None:
            self._request = pcp.MapRequest(await local_address_toward(self._gateway), self._port,
                                           external_port=self._port)
        try:
            granted = await self._exchange(self._request.encode(lifetime), self._parse_pcp)
        except pcp.UnsupportedVersion:
            raise
        except pcp.PcpError as exc:
            raise PortMapError(str(exc)) from None
        self._note_epoch(granted.epoch)
        return Lease(HostPort(granted.external_address, granted.external_port), granted.lifetime)

    async def _map_natpmp(self, lifetime: int) -> Lease:
        try:
            external = await self._exchange(natpmp.external_address_request(), natpmp.parse_external_address)
            granted = await self._exchange(natpmp.map_udp_request(self._port, self._port, lifetime),
                                           natpmp.parse_map_udp)
        except natpmp.NatPmpError as exc:
            raise PortMapError(str(exc)) from None
        self._note_epoch(granted.epoch)
        return Lease(HostPort(external, granted.external_port), granted.lifetime)

    def _parse_pcp(self, data: bytes) -> pcp.MapResult:
        return pcp.parse_map_response(data, self._request)

    def _note_epoch(self, epoch: int) -> None:
        if self._epoch.lost_state(epoch, trio.current_time()):
            log.info("gateway %s lost its mappings (restarted?); ours is mapped again", self._gateway)

    # --- I/O ----------------------------------------------------------------------------

    async def _exchange(self, request: bytes, parse: Callable[[bytes], T]) -> T:
        """Send ``request`` to the gateway with retransmission; ``parse`` of its answer.

        Datagrams ``parse`` finds Malformed (not an answer to this request) are
        ignored; its other errors propagate.  PortMapError if nothing answers.
        """
        try:
            with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                await sock.connect((self._gateway, pcp.PORT))
                wait = FIRST_WAIT
                for _ in range(TRIES):
                    await sock.send(request)
                    with trio.move_on_after(wait):
                        while True:
                            data = await sock.recv(pcp.MAX_MESSAGE_SIZE + 4)
                            try:
                                return parse(data)
                            except Malformed as exc:
                                log.debug("ignored a datagram from %s: %s", self._gateway, exc)
                    wait *= 2
        except ConnectionRefusedError:
            raise PortMapError(f"{self._gateway} runs no PCP or NAT-PMP service") from None
        except OSError as exc:
            raise PortMapError(f"PCP / NAT-PMP to {self._gateway}: {exc}") from None
        raise PortMapError(f"no PCP or NAT-PMP answer from {self._gateway}")
