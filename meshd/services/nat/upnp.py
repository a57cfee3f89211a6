"""UPnP-IGD port mapping: find the gateway's WAN connection service, map, renew, delete.

Discovery sends SSDP M-SEARCHes for the WAN connection services and takes
answers from the default gateway only; the device description and every
SOAP action go to the gateway's own address (the sans-IO core refuses URLs
that point elsewhere), each HTTP exchange bounded in time and size.  A
mapping is asked for with a lease (AddAnyPortMapping on IGD v2, which picks
a free external port if ours is taken; AddPortMapping on v1, trying a few
random ports after a conflict), renewed by adding it again before the lease
ends, and deleted on shutdown.  A v1 gateway that only keeps permanent
mappings (error 725) gets one, deleted on shutdown all the same.
"""

from __future__ import annotations

import logging
import random
import socket

import trio

from nat import minihttp, upnp
from nat.errors import Malformed

from ...address import HostPort
from .mapping import Lease, PortMapError, check_external, local_address_toward

log = logging.getLogger("meshd.portmap")

SEARCH_SECONDS = 3.0  # M-SEARCH answers come within MX (2 s) plus a little
SEARCH_RESEND = 1.0  # send the searches again once, in case the first datagrams were lost
HTTP_SECONDS = 5.0  # one HTTP exchange with the gateway, connect to close
CONFLICT_TRIES = 3  # random external ports tried on a v1 gateway after ours is taken
DESCRIPTION = "meshd"


class UpnpClient:
    """A UDP mapping of ``port`` through the default gateway's Internet Gateway Device."""

    name = "upnp"

    def __init__(self, gateway: str, port: int, rng: random.Random | None = None):
        self._gateway = gateway
        self._port = port
        self._rng = rng or random.SystemRandom()
        self._service: upnp.Service | None = None
        self._local: str | None = None
        self._external_port: int | None = None  # once mapped

    async def map(self, lifetime: int) -> Lease:
        try:
            if self._service is None:
                self._local = await local_address_toward(self._gateway)
                self._service = await self._discover()
            answer = await self._action("GetExternalIPAddress", upnp.get_external_ip_address(self._service))
            external = answer.get("NewExternalIPAddress", "")
            check_external(external)
            port, lease = await self._add(lifetime)
        except (upnp.UpnpError, Malformed, OSError) as exc:
            raise PortMapError(f"UPnP at {self._gateway}: {exc}") from None
        self._external_port = port
        return Lease(HostPort(external, port), lease)

    async def unmap(self) -> None:
        if self._service is None or self._external_port is None:
            return
        try:
            await self._action("DeletePortMapping", upnp.delete_port_mapping(self._service, self._external_port))
        except (upnp.UpnpError, Malformed) as exc:
            raise PortMapError(f"UPnP at {self._gateway}: {exc}") from None
        self._external_port = None

    # --- mapping ------------------------------------------------------------------------

    async def _add(self, lifetime: int) -> tuple[int, int]:
        """(external port, lease) of a new or renewed mapping."""
        if self._external_port is not None:  # renewal: the same mapping again
            return self._external_port, await self._add_exactly(self._external_port, lifetime)
        if self._service.version >= 2:
            try:
                return await self._add_any(lifetime), lifetime
            except upnp.UpnpError as exc:
                if exc.code != upnp.INVALID_ACTION:
                    raise
        *tries, last = [self._port] + [self._rng.randrange(1024, 65536) for _ in range(CONFLICT_TRIES)]
        for port in tries:
            try:
                return port, await self._add_exactly(port, lifetime)
            except upnp.UpnpError as exc:
                if exc.code != upnp.CONFLICT_IN_MAPPING_ENTRY:
                    raise
                log.info("UPnP: external port %d is taken at %s", port, self._gateway)
        return last, await self._add_exactly(last, lifetime)

    async def _add_any(self, lifetime: int) -> int:
        answer = await self._action("AddAnyPortMapping", upnp.add_port_mapping(
            self._service, self._port, self._local, self._port, lifetime, DESCRIPTION, any_port=True))
        return upnp.port_argument(answer, "NewReservedPort")

    async def _add_exactly(self, external_port: int, lifetime: int) -> int:
        """Map ``external_port``; the lease granted (0: permanent, on a gateway that knows no other)."""
        try:
            await self._action("AddPortMapping", upnp.add_port_mapping(
                self._service, external_port, self._local, self._port, lifetime, DESCRIPTION))
            return lifetime
        except upnp.UpnpError as exc:
            if exc.code != upnp.ONLY_PERMANENT_LEASES_SUPPORTED or lifetime == 0:
                raise
        log.info("UPnP: %s keeps permanent mappings only", self._gateway)
        await self._action("AddPortMapping", upnp.add_port_mapping(
            self._service, external_port, self._local, self._port, 0, DESCRIPTION))
        return 0

    # --- I/O ----------------------------------------------------------------------------

    async def _discover(self) -> upnp.Service:
        """The gateway's WAN connection service: SSDP, then its device description."""
        location = await self._search()
        answer = await self._http(location, upnp.description_request(location), upnp.MAX_DESCRIPTION_SIZE)
        if answer.status != 200:
            raise PortMapError(f"UPnP description {location}: HTTP status {answer.status}")
        service = upnp.parse_description(answer.body, location)
        log.info("UPnP: %s at %s", service.service_type.rsplit(":", 2)[1], service.control)
        return service

    async def _search(self) -> minihttp.Url:
        """The description URL from the first valid M-SEARCH answer sent by the gateway."""
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with sock:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 2)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(self._local))
            await sock.bind((self._local, 0))
            with trio.move_on_after(SEARCH_SECONDS):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._send_searches, sock)
                    location = await self._first_answer(sock)
                    nursery.cancel_scope.cancel()
                return location
        raise PortMapError(f"no UPnP answer from {self._gateway}")

    async def _send_searches(self, sock) -> None:
        for _ in range(2):
            for service_type in upnp.SERVICE_TYPES:
                await sock.sendto(upnp.search_request(service_type), (upnp.SSDP_GROUP, upnp.SSDP_PORT))
            await trio.sleep(SEARCH_RESEND)

    async def _first_answer(self, sock) -> minihttp.Url:
        while True:
            data, (host, _) = await sock.recvfrom(upnp.MAX_SSDP_SIZE + 1)
            if host != self._gateway:
                log.debug("UPnP: ignored an SSDP answer from %s (not the gateway)", host)
                continue
            try:
                return upnp.parse_search_response(data, host)
            except Malformed as exc:
                log.debug("UPnP: ignored an SSDP answer from %s: %s", host, exc)

    async def _action(self, action: str, request: bytes) -> dict[str, str]:
        answer = await self._http(self._service.control, request, upnp.MAX_SOAP_SIZE)
        return upnp.parse_soap_response(answer, self._service, action)

    async def _http(self, url: minihttp.Url, request: bytes, limit: int) -> minihttp.Response:
        """One exchange with the gateway (``url`` is on it), at most ``limit``
        bytes of body and :data:`HTTP_SECONDS` long; PortMapError if it fails."""
        data = bytearray()
        try:
            with trio.fail_after(HTTP_SECONDS):
                async with await trio.open_tcp_stream(url.host, url.port) as stream:
                    await stream.send_all(request)
                    while chunk := await stream.receive_some(16384):
                        data += chunk
                        if len(data) > limit + minihttp.MAX_HEADER_SIZE:
                            raise PortMapError(f"{url}: the answer is larger than {limit} bytes")
        except (OSError, trio.BrokenResourceError) as exc:
            raise PortMapError(f"{url}: {exc}") from None
        except trio.TooSlowError:
            raise PortMapError(f"{url}: no complete answer in {HTTP_SECONDS:g} s") from None
        return minihttp.parse_response(bytes(data))
