"""``meshctl dht``: records, providers and the routing table of the DHT service."""

from __future__ import annotations

import argparse
import time

import meshd

from ..common import command_group, console, rich_table, rows_table


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
    from dht.records import RecordError, owned_key

    peer_id = meshd.PeerId.from_string((await client.id())["peer_id"])
    try:
        return owned_key(peer_id.key, name)
    except RecordError as exc:
        raise meshd.InvalidArgument(str(exc)) from None


async def cmd_dht_put(client: meshd.Client, args) -> object:
    key = await _record_key(client, args)
    replicas = await client.dht_put(key, _bytes(args.value), ttl=args.ttl)
    result = {"key": _shown(key), "replicas": replicas}
    return result, lambda: console().print(f"stored {result['key']} on {_nodes(replicas)}",
                                           highlight=False, soft_wrap=True)


async def cmd_dht_get(client: meshd.Client, args) -> object:
    key = await _record_key(client, args)
    record = await client.dht_get(key)
    if record is None:
        raise meshd.NotFound(f"no record under {_shown(key)}")
    result = {**record, "key": _shown(record["key"]), "value": _shown(record["value"])}

    def show() -> None:
        table = rich_table(show_header=False, box=None)
        for name in ("key", "value", "author", "seq"):
            table.add_row(name, str(result[name]))
        expires = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(result["expires"]))
        table.add_row("expires", f"{expires} (in {max(0, result['expires'] - time.time()) / 60:.0f} min)")
        console().print(table)

    return result, show


async def cmd_dht_provide(client: meshd.Client, args) -> object:
    replicas = await client.dht_provide(_bytes(args.key))
    result = {"key": args.key, "replicas": replicas}
    return result, lambda: console().print(f"announced as a provider of {args.key} to {_nodes(replicas)}",
                                           highlight=False, soft_wrap=True)


async def cmd_dht_providers(client: meshd.Client, args) -> object:
    rows = await client.dht_providers(_bytes(args.key), count=args.count)
    table_rows = [{**row, "addrs": ", ".join(row["addrs"])} for row in rows]
    return rows, lambda: console().print(
        rows_table(f"{len(rows)} providers of {args.key}", table_rows, ["peer_id", "addrs"]))


async def cmd_dht_routing(client: meshd.Client, args) -> object:
    info = await client.dht_routing()
    rows = [{**row, "addrs": ", ".join(row["addrs"])} for row in info["contacts"]]
    title = (f"DHT in {info['mode']} mode; contacts: {info['size']}, records held: {info['records']}, "
             f"keys provided: {info['providing']}")
    return info, lambda: console().print(rows_table(title, rows, ["peer_id", "bucket", "addrs"]))


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    """The ``dht`` command and its subcommands."""
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
