"""The NAT service's control methods: ``nat``, ``stun``, ``relay`` and ``punch``."""

from __future__ import annotations

from nat.stun_client import StunFailure

from ...address import AddressError, HostPort
from ...rpc import InvalidArgument, Unavailable
from ...rpc.args import field, peer_field
from ...transport import DialError


def control_methods(nat) -> dict:
    """The control methods, bound to ``nat``, the :class:`~meshd.services.nat.Nat`
    service (not imported here: it imports this module)."""

    async def status(arg, ctx):
        if isinstance(arg, dict) and arg.get("discover"):
            await nat.stun.discover(nat.stun_servers())
        if isinstance(arg, dict) and arg.get("autonat"):
            await nat.autonat.check()
        return nat.nat_status()

    async def stun(arg, ctx):
        try:
            server = HostPort.parse(field(arg, "server", str))
            return {"server": str(server), "reflexive": await nat.stun.query(server)}
        except (AddressError, DialError) as exc:
            raise InvalidArgument(str(exc)) from None
        except StunFailure as exc:
            raise Unavailable(str(exc)) from None

    async def relay(arg, ctx):
        if isinstance(arg, dict) and "reserve" in arg:
            await nat.relay.reserve(peer_field(arg, "reserve"))
        return nat.relay.status()

    async def punch(arg, ctx):
        conn = await nat.puncher.punch(peer_field(arg))
        return {"punched": conn is not None, "path": conn.path if conn else None}

    return {"nat": status, "stun": stun, "relay": relay, "punch": punch}
