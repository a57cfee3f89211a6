"""``meshctl`` commands of the node core: identity, status, peers, dialing, raw calls."""

from __future__ import annotations

import argparse
import json

import meshd

from ..common import command_adder, console, rich_table, rows_table


async def cmd_id(client: meshd.Client, args) -> object:
    result = await client.id()
    return result, lambda: console().print(result["address"], highlight=False, soft_wrap=True)


async def cmd_status(client: meshd.Client, args) -> object:
    result = await client.status()

    def show() -> None:
        table = rich_table(show_header=False, box=None)
        for key, value in result.items():
            table.add_row(key, _shown(value))
        console().print(table)

    return result, show


def _shown(value: object) -> str:
    """A status value on one line: lists joined, a service's dict as ``key value, ...``."""
    if isinstance(value, list):
        return ", ".join(map(str, value))
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return str(value)


async def cmd_peers(client: meshd.Client, args) -> object:
    rows = await client.peers()
    columns = ["peer_id", "address", "path", "direction", "rtt_ms", "connected_s", "streams", "datagram"]
    return rows, lambda: console().print(rows_table(f"{len(rows)} connected peers", rows, columns))


async def cmd_ping(client: meshd.Client, args) -> object:
    rtts = []
    for _ in range(args.count):
        rtts.append(await client.ping(args.peer))
        if not args.json:
            console().print(f"reply from {args.peer[:10]}...: {rtts[-1]:.3f} ms", highlight=False)
    rtts.sort()
    result = {"peer_id": args.peer, "rtt_ms": rtts, "min_ms": rtts[0],
              "median_ms": rtts[len(rtts) // 2], "max_ms": rtts[-1]}
    return result, lambda: console().print(
        f"{len(rtts)} pings: min {rtts[0]:.3f} / median {result['median_ms']:.3f} / max {rtts[-1]:.3f} ms",
        highlight=False,
    )


async def cmd_connect(client: meshd.Client, args) -> object:
    result = {"peer_id": await client.connect(args.addr, via=args.via)}
    return result, lambda: console().print(f"connected to {result['peer_id']}", highlight=False)


async def cmd_disconnect(client: meshd.Client, args) -> object:
    done = await client.disconnect(args.peer)
    result = {"peer_id": args.peer, "disconnected": done}
    text = "disconnected" if done else "was not connected to"
    return result, lambda: console().print(f"{text} {args.peer}", highlight=False)


async def cmd_call(client: meshd.Client, args) -> object:
    try:
        arg = json.loads(args.arg) if args.arg is not None else None
    except json.JSONDecodeError as exc:
        raise meshd.InvalidArgument(f"ARG is not JSON: {exc}") from None
    result = await client.call(args.peer, args.method, arg, timeout=args.timeout)
    return result, lambda: console().print_json(data=result, default=repr)


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    """The node core's commands: id, status, peers, ping, connect, disconnect, call."""
    add = command_adder(sub, common)
    add("id", cmd_id, "this node's PeerId and address")
    add("status", cmd_status, "uptime, connections, services")
    add("peers", cmd_peers, "connected peers with path and RTT")
    p = add("ping", cmd_ping, "round-trip time to a peer")
    p.add_argument("peer")
    p.add_argument("-c", "--count", type=int, default=3)
    p = add("connect", cmd_connect, "dial PEERID@HOST:PORT, or PEERID --via RELAY_PEERID")
    p.add_argument("addr")
    p.add_argument("--via", metavar="RELAY", help="reach PEERID through this relay (it must hold a reservation)")
    add("disconnect", cmd_disconnect, "close the connection to a peer").add_argument("peer")
    p = add("call", cmd_call, "unary RPC to a peer: METHOD with a JSON argument")
    p.add_argument("peer")
    p.add_argument("method")
    p.add_argument("arg", nargs="?", help="JSON argument (default null)")
    p.add_argument("--timeout", type=float, default=30.0)
