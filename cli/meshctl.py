"""``meshctl``: inspect and steer the local meshd through its control socket.

Every command prints a rich table or line for people, or JSON with ``--json``
for scripts.  Failures are one line on stderr and exit code 1 (2 for usage).
"""

from __future__ import annotations

import argparse
import json
import time

import trio
from rich.console import Console
from rich.table import Table

import meshd
from dht.records import RecordError, owned_key

from . import crdt_commands, shard_commands
from .common import command_adder, command_group, data_dir_argument, fail

console = Console()


def _rows_table(title: str, rows: list[dict], columns: list[str]) -> Table:
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*("-" if row.get(c) is None else str(row.get(c)) for c in columns))
    return table


async def cmd_id(client: meshd.Client, args) -> object:
    result = await client.id()
    return result, lambda: console.print(result["address"], highlight=False, soft_wrap=True)


async def cmd_status(client: meshd.Client, args) -> object:
    result = await client.status()

    def show() -> None:
        table = Table(show_header=False, box=None)
        for key, value in result.items():
            table.add_row(key, ", ".join(value) if isinstance(value, list) else str(value))
        console.print(table)

    return result, show


async def cmd_peers(client: meshd.Client, args) -> object:
    rows = await client.peers()
    columns = ["peer_id", "address", "path", "direction", "rtt_ms", "connected_s", "streams"]
    return rows, lambda: console.print(_rows_table(f"{len(rows)} connected peers", rows, columns))


async def cmd_ping(client: meshd.Client, args) -> object:
    rtts = []
    for _ in range(args.count):
        rtts.append(await client.ping(args.peer))
        if not args.json:
            console.print(f"reply from {args.peer[:10]}...: {rtts[-1]:.3f} ms", highlight=False)
    rtts.sort()
    result = {"peer_id": args.peer, "rtt_ms": rtts, "min_ms": rtts[0],
              "median_ms": rtts[len(rtts) // 2], "max_ms": rtts[-1]}
    return result, lambda: console.print(
        f"{len(rtts)} pings: min {rtts[0]:.3f} / median {result['median_ms']:.3f} / max {rtts[-1]:.3f} ms",
        highlight=False,
    )


async def cmd_connect(client: meshd.Client, args) -> object:
    result = {"peer_id": await client.connect(args.addr, via=args.via)}
    return result, lambda: console.print(f"connected to {result['peer_id']}", highlight=False)


async def cmd_disconnect(client: meshd.Client, args) -> object:
    done = await client.disconnect(args.peer)
    result = {"peer_id": args.peer, "disconnected": done}
    text = "disconnected" if done else "was not connected to"
    return result, lambda: console.print(f"{text} {args.peer}", highlight=False)


async def cmd_nat(client: meshd.Client, args) -> object:
    if args.stun:
        await client.stun(args.stun)
    result = await client.nat(discover=args.discover, autonat=args.autonat)

    def show() -> None:
        table = Table(show_header=False, box=None)
        table.add_row("listen", result["listen"])
        for server, mapped in result["reflexive"].items():
            table.add_row(f"reflexive via {server}", mapped)
        if not result["reflexive"]:
            table.add_row("reflexive", "- (no STUN server asked yet: meshctl nat --stun HOST:PORT)")
        table.add_row("mapping", result["mapping"] or "- (meshctl nat --discover)")
        pm = result["port_mapping"]
        table.add_row("port mapping", f"{pm['external']} via {pm['gateway']} ({pm['lifetime']} s)" if pm else "none")
        if result["port_preserved"] is not None:
            table.add_row("port preserved", "yes" if result["port_preserved"] else "no")
        reach = result["reachability"]
        if result["reachability_via"]:
            reach += f" ({result['reachability_address']} dialed by {result['reachability_via'][:10]}...)"
        table.add_row("reachability", reach)
        table.add_row("filtering", result["filtering"] or "- (meshctl nat --autonat)")
        hairpin = result["hairpinning"]
        table.add_row("hairpinning", "-" if hairpin is None else ("yes" if hairpin else "no"))
        for relay, left in result["relay_reservations"].items():
            table.add_row(f"relay reservation at {relay[:10]}...", f"{left} s left")
        table.add_row("STUN requests answered", str(result["stun_answered"]))
        console.print(table)

    return result, show


async def cmd_relay(client: meshd.Client, args) -> object:
    result = await client.relay(reserve=args.reserve)

    def show() -> None:
        table = Table(show_header=False, box=None)
        table.add_row("relaying for others", "on" if result["enabled"] else "off ([relay] enabled)")
        for peer, held in result["serving"].items():
            table.add_row(f"serving {peer[:10]}...", f"{held['circuits']} circuits, {held['expires_in']} s left")
        for peer, left in result["reserved_at"].items():
            table.add_row(f"reserved at {peer[:10]}...", f"{left} s left")
        console.print(table)

    return result, show


async def cmd_punch(client: meshd.Client, args) -> object:
    result = {"peer_id": args.peer, "punched": await client.punch(args.peer)}
    text = "direct path punched to" if result["punched"] else "hole punching failed; still relayed to"
    return result, lambda: console.print(f"{text} {args.peer}", highlight=False)


async def cmd_call(client: meshd.Client, args) -> object:
    try:
        arg = json.loads(args.arg) if args.arg is not None else None
    except json.JSONDecodeError as exc:
        raise meshd.InvalidArgument(f"ARG is not JSON: {exc}") from None
    result = await client.call(args.peer, args.method, arg, timeout=args.timeout)
    return result, lambda: console.print_json(data=result, default=repr)


def _bytes(text: str) -> bytes:
    """Command-line text as bytes: hex when written ``0x...``, else UTF-8."""
    if not text.startswith("0x"):
        return text.encode()
    try:
        return bytes.fromhex(text[2:])
    except ValueError:
        raise meshd.InvalidArgument(f"{text!r} starts with 0x but is not hex") from None


def _nodes(count: int) -> str:
    return f"{count} other node" + ("" if count == 1 else "s")


def _shown(data: bytes) -> str:
    """Bytes for display: the text when they are UTF-8, else ``0x`` and hex."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "0x" + data.hex()


async def _record_key(client: meshd.Client, args) -> bytes:
    """The record key KEY names: ``/open/KEY`` unless it starts with "/", or
    ``/owned/<this node's key hex>/KEY`` with ``--owned``."""
    name = _bytes(args.key)
    if not getattr(args, "owned", False):
        return name if name.startswith(b"/") else b"/open/" + name
    if name.startswith(b"/"):
        raise meshd.InvalidArgument("--owned takes a NAME without a leading '/'")
    peer_id = meshd.PeerId.from_string((await client.id())["peer_id"])
    try:
        return owned_key(peer_id.key, name)
    except RecordError as exc:
        raise meshd.InvalidArgument(str(exc)) from None


async def cmd_dht_put(client: meshd.Client, args) -> object:
    key = await _record_key(client, args)
    replicas = await client.dht_put(key, _bytes(args.value), ttl=args.ttl)
    result = {"key": _shown(key), "replicas": replicas}
    return result, lambda: console.print(f"stored {result['key']} on {_nodes(replicas)}",
                                         highlight=False, soft_wrap=True)


async def cmd_dht_get(client: meshd.Client, args) -> object:
    key = await _record_key(client, args)
    record = await client.dht_get(key)
    if record is None:
        raise meshd.NotFound(f"no record under {_shown(key)}")
    result = {**record, "key": _shown(record["key"]), "value": _shown(record["value"])}

    def show() -> None:
        table = Table(show_header=False, box=None)
        for name in ("key", "value", "author", "seq"):
            table.add_row(name, str(result[name]))
        expires = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(result["expires"]))
        table.add_row("expires", f"{expires} (in {max(0, result['expires'] - time.time()) / 60:.0f} min)")
        console.print(table)

    return result, show


async def cmd_dht_provide(client: meshd.Client, args) -> object:
    replicas = await client.dht_provide(_bytes(args.key))
    result = {"key": args.key, "replicas": replicas}
    return result, lambda: console.print(f"announced as a provider of {args.key} to {_nodes(replicas)}",
                                         highlight=False, soft_wrap=True)


async def cmd_dht_providers(client: meshd.Client, args) -> object:
    rows = await client.dht_providers(_bytes(args.key), count=args.count)
    table_rows = [{**row, "addrs": ", ".join(row["addrs"])} for row in rows]
    return rows, lambda: console.print(
        _rows_table(f"{len(rows)} providers of {args.key}", table_rows, ["peer_id", "addrs"]))


async def cmd_dht_routing(client: meshd.Client, args) -> object:
    info = await client.dht_routing()
    rows = [{**row, "addrs": ", ".join(row["addrs"])} for row in info["contacts"]]
    title = (f"DHT in {info['mode']} mode; contacts: {info['size']}, records held: {info['records']}, "
             f"keys provided: {info['providing']}")
    return info, lambda: console.print(_rows_table(title, rows, ["peer_id", "bucket", "addrs"]))


def _parser() -> argparse.ArgumentParser:
    def options(parser: argparse.ArgumentParser, suppress: bool) -> argparse.ArgumentParser:
        data_dir_argument(parser, suppress=suppress)
        parser.add_argument("--json", action="store_true", help="print JSON for scripts",
                            default=argparse.SUPPRESS if suppress else False)
        return parser

    common = options(argparse.ArgumentParser(add_help=False), suppress=True)
    parser = options(argparse.ArgumentParser(prog="meshctl", description="control a running meshd"),
                     suppress=False)
    sub = parser.add_subparsers(dest="command", required=True)
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
    add("punch", cmd_punch, "try a direct path to a peer reached through a relay").add_argument("peer")
    p = add("relay", cmd_relay, "relay reservations: held here and ours elsewhere")
    p.add_argument("--reserve", metavar="RELAY", help="reserve a slot at this relay first")
    add("disconnect", cmd_disconnect, "close the connection to a peer").add_argument("peer")
    p = add("nat", cmd_nat, "reflexive addresses (STUN) and NAT facts")
    p.add_argument("--stun", metavar="HOST:PORT", help="ask this STUN server (any meshd port works) first")
    p.add_argument("--discover", action="store_true",
                   help="ask the configured STUN servers and all connected peers, classify the mapping")
    p.add_argument("--autonat", action="store_true",
                   help="have a peer arrange a dial-back from a third peer: are we reachable?")
    p = add("call", cmd_call, "unary RPC to a peer: METHOD with a JSON argument")
    p.add_argument("peer")
    p.add_argument("method")
    p.add_argument("arg", nargs="?", help="JSON argument (default null)")
    p.add_argument("--timeout", type=float, default=30.0)

    add_dht = command_group(sub, common, "dht", "the DHT: records, providers, routing table",
                            "KEY and VALUE are text, or hex written 0x...; a record KEY "
                            "without a leading '/' means /open/KEY")

    p = add_dht("put", cmd_dht_put, "store a signed record")
    p.add_argument("key")
    p.add_argument("value")
    p.add_argument("--ttl", type=float, help="seconds the record lives (default: dht.record_ttl)")
    p.add_argument("--owned", action="store_true",
                   help="put under /owned/<this node's key>/KEY, which only this node may write")
    p = add_dht("get", cmd_dht_get, "the newest record under a key")
    p.add_argument("key")
    p.add_argument("--owned", action="store_true", help="KEY is a name under this node's /owned/ prefix")
    add_dht("provide", cmd_dht_provide, "announce this node as a provider of a key").add_argument("key")
    p = add_dht("providers", cmd_dht_providers, "peers that provide a key")
    p.add_argument("key")
    p.add_argument("-n", "--count", type=int, default=20, help="at most this many (default 20)")
    add_dht("routing", cmd_dht_routing, "the routing table")
    crdt_commands.add_parser(sub, common)
    shard_commands.add_parser(sub, common)
    return parser


async def _run(args) -> None:
    async with meshd.connect(args.data_dir) as client:
        result, show = await args.func(client, args)
    if show is None:  # the command printed as it went
        return
    if args.json:
        print(json.dumps(result, default=lambda v: v.hex() if isinstance(v, bytes) else repr(v)))
    else:
        show()


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if getattr(args, "count", 1) < 1:
        fail("meshctl", "--count must be at least 1", 2)
    try:
        trio.run(_run, args)
    except KeyboardInterrupt:
        raise SystemExit(130)
    except meshd.DaemonNotRunning as exc:
        fail("meshctl", str(exc))
    except meshd.RpcError as exc:
        fail("meshctl", exc.message or exc.code)


if __name__ == "__main__":
    main()
