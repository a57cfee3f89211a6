"""AutoNAT: can strangers reach this node?  Asked of peers, answered by a third one.

A node N asks a connected peer A (``autonat.request``).  A picks another of
its peers, B, and asks it (``autonat.dial_back``) to open a fresh QUIC
connection to the address A sees N at.  N names the peers it sent to lately
(``exclude``) and A skips them; B refuses if it is connected to N or
exchanged packets with that address lately (a connection, or STUN).  So N's
NAT holds no filter entry for B: the dial succeeds only if N is reachable by anyone.  A reports
the outcome to N.  B keeps the connection it opened (both nodes adopt it as
their connection to each other); it closes when idle, like any other.

Only the address A itself observed is dialed, never one N names, so the
service cannot be used to aim traffic at third parties; each requester gets
one dial-back per ``nat.autonat_interval`` (``REQUEST_INTERVAL``, 10 s).  Those rules and the verdict are
:mod:`nat.autonat`'s; this module does the I/O.
"""

from __future__ import annotations

import logging
import random
import trio

from nat.autonat import (DIAL_TIMEOUT, REQUEST_INTERVAL, PerPeerInterval, Verdict, backoff_delays,
                         choose_helpers, contacted, dial_back_check, parse_dial_back, parse_exclude,
                         reachable_of)

from ...address import HostPort, plain_address
from ...identity import PeerId
from ...rpc import InvalidArgument, NotFound, RpcError
from ...rpc.args import to_peer
from ...service import Host
from ...transport import DialError
from .errors import parse_hostport, rpc_errors
from .stun import NodeStun

log = logging.getLogger("meshd.autonat")


class AutoNat:
    """Serves both AutoNAT roles on a node and keeps its own verdict (a :class:`nat.autonat.Verdict`)."""

    def __init__(self, host: Host, stun: NodeStun, rng: random.Random | None = None, *,
                 request_interval: float = REQUEST_INTERVAL):
        self._node = host
        self._stun = stun
        self._rng = rng or random.Random()
        self._requests = PerPeerInterval(request_interval, "AutoNAT request")  # served per peer
        self.verdict = Verdict()
        self.settled = trio.Event()  # the first round of checks ended, with a verdict or without
        self.changed = trio.lowlevel.ParkingLot()  # unparked whenever the status changes

    @property
    def status(self) -> str:
        """"public", "private" or "unknown"; settable, for a test standing in for a verdict."""
        return self.verdict.status

    @status.setter
    def status(self, value: str) -> None:
        self.verdict.status = value

    @property
    def address(self) -> str | None:
        """The address that was dialed back."""
        return self.verdict.address

    @property
    def via(self) -> str | None:
        """The peer that dialed."""
        return self.verdict.via

    def rpc_methods(self) -> dict:
        return {"autonat.request": self._serve_request, "autonat.dial_back": self._serve_dial_back}

    # --- the asking node -------------------------------------------------------

    async def check(self) -> str:
        """Ask connected peers until one can arrange a dial-back; returns the status.

        "public" if a third peer reached us, "private" if it could not,
        "unknown" if no peer could find a third one.
        """
        peers = self._node.connected()
        self._rng.shuffle(peers)
        for peer in peers:
            exclude = contacted(self._node.endpoint.dialed, self._node.connected(), trio.current_time())
            try:
                reply = await self._node.rpc.call(
                    peer, "autonat.request", {"exclude": exclude}, timeout=DIAL_TIMEOUT * 3)
            except RpcError as exc:
                log.debug("autonat via %s: %s", peer, exc)
                continue
            changed = self.verdict.apply(reply)
            if changed is None:
                continue
            if changed:
                self.changed.unpark_all()
            log.info("AutoNAT: %s at %s (dialed by %s)", self.status, self.address, self.via)
            return self.status
        return self.status

    async def keep_checking(self) -> None:
        """Check until there is a verdict (backing off), then again whenever STUN
        reports a public address we had not seen."""
        while True:
            for delay in backoff_delays():
                if await self.check() != "unknown":
                    break
                log.info("AutoNAT: no verdict yet (%d peers connected); asking again in %.0f s",
                         len(self._node.connected()), delay)
                await trio.sleep(delay)  # peers, or a third peer for them, may still be coming
            self.settled.set()
            await self._stun.address_changed.park()

    # --- the asked node (A) ----------------------------------------------------

    async def _serve_request(self, arg: object, ctx) -> dict:
        requester: PeerId = ctx.peer
        now = trio.current_time()
        with rpc_errors():
            self._requests.check(requester, now)
            excluded = parse_exclude(arg)
        observed = ctx.info.get("remote")
        if observed is None:
            raise InvalidArgument("no observed address for this caller")
        address = str(HostPort(*plain_address(observed)))
        for helper in choose_helpers(self._node.connected(), requester, excluded, self._rng):
            try:
                result = await self._node.rpc.call(
                    helper, "autonat.dial_back", {"peer": str(requester), "addr": address},
                    timeout=DIAL_TIMEOUT * 2,
                )
            except RpcError as exc:
                log.debug("autonat helper %s: %s", helper, exc)
                continue
            reachable = reachable_of(result)
            if reachable is not None:
                self._requests.record(requester, now)  # only a dial made counts against the budget
                return {"reachable": reachable, "address": address, "via": str(helper)}
        raise NotFound("no third peer could dial back")

    # --- the third node (B) ----------------------------------------------------

    async def _serve_dial_back(self, arg: object, ctx) -> dict:
        with rpc_errors():
            peer_text, addr_text = parse_dial_back(arg)
            target = to_peer(peer_text)
            hostport = parse_hostport(addr_text)
            dial_back_check(self._node.live(target) is not None,
                            self._talked_to_recently((hostport.host, hostport.port)))
        try:
            conn = await self._node.endpoint.dial(hostport.host, hostport.port, target, timeout=DIAL_TIMEOUT)
        except DialError as exc:
            log.debug("autonat dial-back to %s failed: %s", hostport, exc)
            return {"reachable": False}
        # Kept, not closed: both nodes took it as their connection to each other, and
        # closing it cut off calls the requester had just started on it.  It closes when
        # idle, like any other.
        log.debug("autonat dial-back to %s reached it (%s)", hostport, conn.peer_id)
        return {"reachable": True}

    def _talked_to_recently(self, address: tuple[str, int]) -> bool:
        """Whether we exchanged packets with ``address`` lately: a live or recent
        connection, or a STUN request we answered (its NAT would let us in)."""
        return self._stun.asked_recently(address) or self._node.recently_connected(address)
