"""``meshctl shards ...`` (or ``shard``): publish, fetch, list and collect models.

REF is NAME, NAME@VERSION, NAME@latest or a model id (64 hex digits); names
resolve in the registry document (``shards.registry`` in the config), then in
the DHT, where a name belongs to the first node that published under it.
"""

from __future__ import annotations

import argparse

import meshd

from ..common import command_group, console, rich_table


def _model_line(info: dict) -> str:
    return (f"{info['name']}@{info['version']} {info['id'][:16]} "
            f"({info['bytes'] / 1e6:,.1f} MB, {info['chunks']} chunks, {info['tensors']} tensors)")


async def cmd_publish(client: meshd.Client, args) -> object:
    info = await client.publish_model(args.file, args.name, args.version)
    return info, lambda: console().print(f"published {_model_line(info)}", highlight=False)


async def cmd_fetch(client: meshd.Client, args) -> object:
    """Pull REF, with a progress bar on stderr (unless --json), and write -o FILE."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    final: dict = {}
    columns = (BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    bar = None  # shown from the first progress item, so an early error stays one line
    try:
        async with client.fetch_model(args.ref, args.output) as items:
            async for item in items:
                if item.get("done"):
                    final = item
                    break
                if bar is None:
                    bar = Progress("[progress.description]{task.description}", *columns,
                                   console=console(stderr=True), disable=args.json, transient=True)
                    bar.start()
                    task = bar.add_task(args.ref, total=None)
                providers = sum(1 for p in item["providers"].values() if p["state"] == "fetching")
                bar.update(task, total=item["total_bytes"], completed=item["have_bytes"],
                           description=f"{args.ref} from {providers} providers")
    finally:
        if bar is not None:
            bar.stop()
    return final, lambda: console().print(
        f"fetched {_model_line(final)}" + (f" -> {final['out']}" if final.get("out") else ""), highlight=False)


async def cmd_ls(client: meshd.Client, args) -> object:
    rows = await client.models()
    table = rich_table(title=f"{len(rows)} models", title_justify="left")
    for col in ("name", "version", "id", "MB", "present", "publisher"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], str(r["version"]), r["id"][:16], f"{r['bytes'] / 1e6:,.1f}",
                      f"{100 * r['present_bytes'] / max(r['bytes'], 1):.0f} %", r["publisher"][:16])
    return rows, lambda: console().print(table)


async def cmd_gc(client: meshd.Client, args) -> object:
    if args.unpin:
        await client.request("shards.unpin", {"id": args.unpin})
    result = await client.request("shards.gc", {"target_bytes": args.target})
    return result, lambda: console().print(
        f"removed {result['removed']} chunks ({result['freed_bytes'] / 1e6:,.1f} MB); "
        f"{result['bytes'] / 1e6:,.1f} MB stored", highlight=False)


async def cmd_name(client: meshd.Client, args) -> object:
    info = await client.request("shards.name", {"name": args.name, "forget_owner": args.forget_owner})
    return info, lambda: _print_name(info)


async def cmd_allow(client: meshd.Client, args) -> object:
    info = await client.request("shards.allow", {"name": args.name, "peer": args.peer, "revoke": args.revoke})
    return info, lambda: _print_name(info)


def _print_name(info: dict) -> None:
    out = console()
    if info.get("forgot_owner"):
        out.print("forgot the owner this node knew; it now trusts the one below", highlight=False)
    out.print(f"{info['name']} owned by {info['owner']}", highlight=False)
    for writer in info["writers"]:
        out.print(f"  may publish: {writer}", highlight=False)
    table = rich_table(title=f"{len(info['versions'])} versions", title_justify="left")
    for col in ("version", "id", "MB", "publisher"):
        table.add_column(col)
    for number, v in info["versions"].items():
        table.add_row(number, v["id"][:16], f"{v['bytes'] / 1e6:,.1f}", v["publisher"][:16])
    out.print(table)


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    """The ``shards`` command (also ``shard``, its first name) and its subcommands."""
    add = command_group(sub, common, "shards", "models: publish, fetch, list, collect", __doc__,
                        aliases=("shard",))

    p = add("publish", cmd_publish, "publish a .safetensors file")
    p.add_argument("file")
    p.add_argument("--name", required=True)
    p.add_argument("--version", type=int, help="default: one above the highest the registry or the name knows")
    p = add("fetch", cmd_fetch, "fetch a model from its providers")
    p.add_argument("ref", help="NAME, NAME@VERSION, NAME@latest or a model id")
    p.add_argument("-o", "--output", help="write it to this .safetensors file")
    add("ls", cmd_ls, "models kept here")
    p = add("name", cmd_name, "a name's owner, publishers and versions in the DHT")
    p.add_argument("name")
    p.add_argument("--forget-owner", action="store_true",
                   help="trust the name's current owner, though another owned it when this node last looked")
    p = add("allow", cmd_allow, "let a peer publish under a name you own")
    p.add_argument("name")
    p.add_argument("peer", help="its PeerId")
    p.add_argument("--revoke", action="store_true", help="no longer let it")
    p = add("gc", cmd_gc, "delete chunks no kept model needs")
    p.add_argument("--unpin", metavar="ID", help="stop keeping this model first")
    p.add_argument("--target", type=int, help="stop once the store is at most this many bytes")
