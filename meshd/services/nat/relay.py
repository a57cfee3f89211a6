"""Relays: a reachable node carries QUIC between two peers that cannot meet directly.

Roles, as in libp2p's circuit relay v2:

* the **target** N (behind a NAT) holds a reservation at relay R
  (``relay.reserve``) and keeps its connection to R open;
* a **dialer** X opens a bidi call ``relay.connect`` to R naming N; R opens
  ``relay.incoming`` to N and copies items both ways, within the limits of
  N's reservation;
* X and N then run an ordinary QUIC connection *inside* that pipe: each item
  is one QUIC datagram, handed to the endpoint through a virtual path.  The
  handshake authenticates N to X and X to N end to end, and R sees only
  ciphertext, so every kind of RPC works over it unchanged; the connection's
  ``path`` is "relayed".

Limits are per reservation (lifetime, circuits at once, bytes and duration
per circuit) and per relay (reservations held); all are in ``[relay]``.  The
books (reservations, circuits, byte budgets, a relay's reply checked) are
:mod:`nat.relay`'s; this module does the I/O.
"""

from __future__ import annotations

import dataclasses
import logging
import trio

from nat.relay import ByteBudget, Circuit, HeldReservations, Pacer, RelayLimits, Reservations, parse_limits

from ...identity import PeerId
from ...rpc import Channel, PermissionDenied, Unavailable
from ...rpc.args import peer_field
from ...service import Host, Method
from ...streams import StreamAborted
from ...transport import DialError, PeerConnection, set_when_terminated
from .config import RelaySection
from .errors import bad_reply, rpc_errors

log = logging.getLogger("meshd.relay")

_OPEN = {"circuit": "open"}
_QUEUE = 256  # datagrams waiting to enter a tunnel; beyond that they are dropped, as UDP would


def relay_limits(config: RelaySection) -> RelayLimits:
    """What the ``[relay]`` section offers, less ``reserve_at_bootstrap``."""
    return RelayLimits(**{f.name: getattr(config, f.name) for f in dataclasses.fields(RelayLimits)})


class Relay:
    """All three relay roles of one node; the books are :mod:`nat.relay`'s."""

    def __init__(self, host: Host, config: RelaySection):
        self._node = host
        self.config = config
        self.reservations = Reservations(relay_limits(config))  # held here, as a relay
        self.reserved_at = HeldReservations()  # relays holding ours (trio clock)
        self._circuits: set[Circuit] = set()  # open here, as a relay
        self._circuits_total = 0
        self._closed_bytes = 0  # carried by circuits closed since start
        self._pacer = Pacer(self.reservations.limits.rate)  # all circuits' bytes together, at the relay's rate

    def rpc_methods(self) -> dict:
        return {"relay.reserve": self._serve_reserve,
                "relay.connect": Method(self._serve_connect, "bidi"),
                "relay.incoming": Method(self._serve_incoming, "bidi")}

    # --- target: reserve a slot ------------------------------------------------

    async def reserve(self, relay: PeerId) -> dict:
        """Ask ``relay`` to carry connections to us; returns its limits.

        Raises the relay's RpcError: PERMISSION_DENIED when relaying is off
        there, RESOURCE_EXHAUSTED when it is full; UNAVAILABLE when its
        answer is malformed.
        """
        reply = await self._node.rpc.call(relay, "relay.reserve", None, timeout=10)
        with bad_reply(relay, "relay.reserve"):
            limits = parse_limits(reply)
        self.reserved_at.held(relay, limits["ttl"], trio.current_time())
        log.info("relay %s holds a reservation for us (%s s)", relay, limits["ttl"])
        return limits

    def live_reservations(self) -> list:
        """The relays that hold a live reservation for us now."""
        return self.reserved_at.live(trio.current_time())

    def status(self) -> dict:
        """Reservations held here (as a relay) and ours at other relays, with seconds left."""
        now = trio.current_time()
        return {
            "enabled": self.reservations.limits.enabled,
            "serving": self.reservations.status(now),
            "reserved_at": self.reserved_at.status(now),
        }

    def figures(self) -> dict:
        """For the metrics service, as a relay: reservations held here, circuits open
        and opened since start, bytes carried (both ways, open circuits included)."""
        carried = self._closed_bytes + sum(c.budget.carried for c in self._circuits)
        return {"relay_reservations": len(self.reservations), "relay_circuits": len(self._circuits),
                "relay_circuits_opened_total": self._circuits_total, "relay_bytes_total": carried}

    # --- relay -----------------------------------------------------------------

    async def _serve_reserve(self, arg: object, ctx) -> dict:
        with rpc_errors():
            return self.reservations.reserve(ctx.peer, trio.current_time())

    async def _serve_connect(self, channel: Channel, ctx) -> None:
        target = peer_field(channel.arg)
        with rpc_errors():
            circuit = self.reservations.open_circuit(
                target, trio.current_time(), connected=self._node.live(target) is not None)
        self._circuits.add(circuit)
        self._circuits_total += 1
        try:
            with circuit:
                async with self._node.rpc.bidi(target, "relay.incoming", {"peer": str(ctx.peer)}) as out:
                    await channel.send(_OPEN)  # the dialer starts tunnelling only after this
                    with trio.move_on_after(circuit.seconds):
                        await _splice(channel, out, circuit.budget, self._pacer)
        finally:
            self._circuits.discard(circuit)
            self._closed_bytes += circuit.budget.carried

    # --- target: accept a circuit ---------------------------------------------

    async def _serve_incoming(self, channel: Channel, ctx) -> None:
        if not self.reserved_at.holds(ctx.peer):
            raise PermissionDenied("we hold no reservation at this relay")
        log.info("relayed circuit from %s via %s", peer_field(channel.arg), ctx.peer)
        await self._tunnel(channel, ready=None)

    # --- dialer ----------------------------------------------------------------

    async def dial_via(self, relay: PeerId, target: PeerId, timeout: float = 15.0) -> PeerConnection:
        """An authenticated QUIC connection to ``target`` carried by ``relay``.

        Raises Unavailable when the relay refuses (no reservation, limits) or
        the handshake through it fails.  The circuit lasts as long as the
        connection.
        """
        send_ready, receive_ready = trio.open_memory_channel(1)
        stop = trio.Event()
        self._node.spawn(self._run_circuit, relay, target, send_ready, stop)
        try:
            with trio.fail_after(timeout):
                addr = await receive_ready.receive()
            if isinstance(addr, Exception):
                raise addr
            conn = await self._node.endpoint.dial_path(addr, target, timeout, f"{target} via {relay}")
        except (trio.TooSlowError, trio.EndOfChannel):
            stop.set()
            raise Unavailable(f"relay {relay} did not open a circuit to {target}") from None
        except DialError as exc:
            stop.set()
            raise Unavailable(str(exc)) from None
        except BaseException:
            stop.set()
            raise
        self._node.spawn(set_when_terminated, conn, stop)
        return conn

    async def _run_circuit(self, relay: PeerId, target: PeerId, ready: trio.MemorySendChannel,
                           stop: trio.Event) -> None:
        """Hold the ``relay.connect`` call open, tunnelling, until ``stop`` is set."""
        try:
            async with self._node.rpc.bidi(relay, "relay.connect", {"peer": str(target)}) as channel:
                if await channel.receive() != _OPEN:  # the relay's refusal raises its RpcError here
                    raise Unavailable("relay answered something other than an open circuit")
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._tunnel, channel, ready)
                    await stop.wait()
                    nursery.cancel_scope.cancel()
        except Exception as exc:  # the dialer may still be waiting on `ready`: tell it why
            try:
                ready.send_nowait(Unavailable(f"relay {relay}: {exc}"))
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        finally:
            ready.close()

    async def _tunnel(self, channel: Channel, ready) -> None:
        """Carry QUIC datagrams between ``channel`` and a virtual path until either ends."""
        endpoint = self._node.endpoint
        outgoing, queued = trio.open_memory_channel(_QUEUE)

        def send(datagram: bytes) -> None:
            try:
                outgoing.send_nowait(datagram)
            except trio.WouldBlock:
                endpoint.stats["relay_dropped"] += 1

        addr = endpoint.attach_path(send)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pump_out, queued, channel, nursery.cancel_scope)
                if ready is not None:
                    ready.send_nowait(addr)
                try:
                    async for datagram in channel:
                        if isinstance(datagram, bytes):
                            endpoint.path_datagram_received(datagram, addr)
                except (Unavailable, StreamAborted):
                    pass
                nursery.cancel_scope.cancel()
        finally:
            endpoint.detach_path(addr)


async def _pump_out(queued: trio.MemoryReceiveChannel, channel: Channel, scope: trio.CancelScope) -> None:
    try:
        async for datagram in queued:
            await channel.send(datagram)
    except (StreamAborted, trio.ClosedResourceError):
        scope.cancel()


async def _splice(a: Channel, b: Channel, budget: ByteBudget, pacer: Pacer) -> None:
    """Copy items both ways until either side ends or ``budget`` says no, each item
    when ``pacer`` lets it pass."""

    async def copy(src: Channel, dst: Channel, scope: trio.CancelScope) -> None:
        try:
            async for item in src:
                size = len(item) if isinstance(item, bytes) else 0
                if not budget.carry(size):
                    log.info("circuit closed at its %d-byte limit", budget.limit)
                    break
                wait = pacer.wait(size, trio.current_time())
                if wait:
                    await trio.sleep(wait)  # pacing: the relay's rate is shared by every circuit
                await dst.send(item)
        except (Unavailable, StreamAborted, trio.ClosedResourceError):
            pass
        scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(copy, a, b, nursery.cancel_scope)
        nursery.start_soon(copy, b, a, nursery.cancel_scope)
