"""AutoNAT: can strangers reach this node?  Asked of peers, answered by a third one.

A node N asks a connected peer A (``autonat.request``).  A picks another of
its peers, B, and asks it (``autonat.dial_back``) to open a fresh QUIC
connection to the address A sees N at.  N names the peers it sent to lately
(``exclude``) and A skips them; B refuses if it is connected to N or
exchanged packets with that address lately (a connection, or STUN).  So N's
NAT holds no filter entry for B: the dial succeeds only if N is reachable by anyone.  A reports
the outcome to N.

Only the address A itself observed is dialed, never one N names, so the
service cannot be used to aim traffic at third parties; each requester gets
one dial-back per ``REQUEST_INTERVAL``.
"""

from __future__ import annotations

import logging
import random
import trio

from ...address import AddressError, HostPort, plain_address
from ...identity import PeerId, PeerIdError
from ...rpc import InvalidArgument, NotFound, ResourceExhausted, RpcError
from ...service import Host
from ...transport import DialError
from .stun import NodeStun

log = logging.getLogger("meshd.autonat")

REQUEST_INTERVAL = 10.0  # seconds between requests from one peer
DIAL_TIMEOUT = 5.0
_MAX_HELPERS = 3  # third peers tried per request
_MAX_EXCLUDED = 256  # peers a requester may rule out as helpers
RECENT_CONTACT = 180.0  # seconds a NAT may keep a filter entry after traffic stops
_VERDICT_TRIES = 8  # checks (backing off 1 s .. 60 s) before waiting for an address change


class AutoNat:
    """Serves both AutoNAT roles on a node and keeps its own verdict."""

    def __init__(self, host: Host, stun: NodeStun):
        self._node = host
        self._stun = stun
        self._last_request: dict[PeerId, float] = {}
        self.status = "unknown"  # "public", "private" or "unknown"
        self.address: str | None = None  # the address that was dialed back
        self.via: str | None = None  # the peer that dialed
        self.settled = trio.Event()  # the first round of checks ended, with a verdict or without
        self.changed = trio.lowlevel.ParkingLot()  # unparked whenever the status changes

    def rpc_methods(self) -> dict:
        return {"autonat.request": self._serve_request, "autonat.dial_back": self._serve_dial_back}

    # --- the asking node -------------------------------------------------------

    async def check(self) -> str:
        """Ask connected peers until one can arrange a dial-back; returns the status.

        "public" if a third peer reached us, "private" if it could not,
        "unknown" if no peer could find a third one.
        """
        peers = self._node.connected()
        random.shuffle(peers)
        for peer in peers:
            try:
                verdict = await self._node.rpc.call(
                    peer, "autonat.request", {"exclude": self._contacted()}, timeout=DIAL_TIMEOUT * 3)
            except RpcError as exc:
                log.debug("autonat via %s: %s", peer, exc)
                continue
            if isinstance(verdict, dict) and isinstance(verdict.get("reachable"), bool):
                status = "public" if verdict["reachable"] else "private"
                if status != self.status:
                    self.status = status
                    self.changed.unpark_all()
                self.address = str(verdict.get("address"))
                self.via = str(verdict.get("via"))
                log.info("AutoNAT: %s at %s (dialed by %s)", self.status, self.address, self.via)
                return self.status
        return self.status

    async def keep_checking(self) -> None:
        """Check until there is a verdict (backing off), then again whenever STUN
        reports a public address we had not seen."""
        while True:
            delay = 1.0
            for _ in range(_VERDICT_TRIES):
                if await self.check() != "unknown":
                    break
                await trio.sleep(delay)  # peers, or a third peer for them, may still be coming
                delay = min(delay * 2, 60.0)
            self.settled.set()
            await self._stun.address_changed.park()

    def _contacted(self) -> list[str]:
        """Peers we sent to lately: our NAT would let them in, so they must not dial back."""
        now = trio.current_time()
        recent = [p for p, when in self._node.endpoint.dialed.items() if now - when < RECENT_CONTACT]
        return [str(p) for p in dict.fromkeys(recent + self._node.connected())][:_MAX_EXCLUDED]

    # --- the asked node (A) ----------------------------------------------------

    async def _serve_request(self, arg: object, ctx) -> dict:
        requester: PeerId = ctx.peer
        now = trio.current_time()
        last = self._last_request.get(requester)
        if last is not None and now - last < REQUEST_INTERVAL:
            raise ResourceExhausted(f"one AutoNAT request per {REQUEST_INTERVAL:g} s")
        observed = ctx.info.get("remote")
        if observed is None:
            raise InvalidArgument("no observed address for this caller")
        address = str(HostPort(*plain_address(observed)))
        excluded = set(arg.get("exclude", [])[:_MAX_EXCLUDED]) if isinstance(arg, dict) else set()
        helpers = [p for p in self._node.connected() if p != requester and str(p) not in excluded]
        random.shuffle(helpers)
        for helper in helpers[:_MAX_HELPERS]:
            try:
                result = await self._node.rpc.call(
                    helper, "autonat.dial_back", {"peer": str(requester), "addr": address},
                    timeout=DIAL_TIMEOUT * 2,
                )
            except RpcError as exc:
                log.debug("autonat helper %s: %s", helper, exc)
                continue
            if isinstance(result, dict) and isinstance(result.get("reachable"), bool):
                self._last_request[requester] = now  # only a dial made counts against the budget
                return {"reachable": result["reachable"], "address": address, "via": str(helper)}
        raise NotFound("no third peer could dial back")

    # --- the third node (B) ----------------------------------------------------

    async def _serve_dial_back(self, arg: object, ctx) -> dict:
        if not isinstance(arg, dict) or not isinstance(arg.get("peer"), str) or not isinstance(arg.get("addr"), str):
            raise InvalidArgument('expected {"peer": PEERID, "addr": HOST:PORT}')
        try:
            target = PeerId.from_string(arg["peer"])
        except PeerIdError as exc:
            raise InvalidArgument(str(exc)) from None
        if self._node.live(target) is not None:
            raise ResourceExhausted("already connected to that peer: a dial-back would prove nothing")
        try:
            hostport = HostPort.parse(arg["addr"])
        except AddressError as exc:
            raise InvalidArgument(str(exc)) from None
        if self._talked_to_recently((hostport.host, hostport.port)):
            raise ResourceExhausted("we exchanged packets with that address lately: a dial-back would prove nothing")
        try:
            conn = await self._node.endpoint.dial(hostport.host, hostport.port, target, timeout=DIAL_TIMEOUT)
        except DialError as exc:
            log.debug("autonat dial-back to %s failed: %s", hostport, exc)
            return {"reachable": False}
        conn.close(reason="AutoNAT dial-back done")
        return {"reachable": True}

    def _talked_to_recently(self, address: tuple[str, int]) -> bool:
        """Whether we exchanged packets with ``address`` lately: a live or recent
        connection, or a STUN request we answered (its NAT would let us in)."""
        return self._stun.asked_recently(address) or self._node.recently_connected(address)
