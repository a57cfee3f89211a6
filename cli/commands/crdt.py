"""``meshctl crdt ...``: replicated documents.

DOC is ``NAME`` (a document this node owns) or ``PEERID/NAME`` (another
node's, joined on first use).  PATH is map keys separated by ``/``.  VALUE is
JSON when it parses as JSON, else text; ELEM is an integer when it parses as
one, else text.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

import meshd
from meshd.client.crdt import split_path

from ..common import command_group, console, rich_table, to_json

if TYPE_CHECKING:
    from rich.table import Table


def _value(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _element(text: str) -> int | str:
    try:
        return int(text)
    except ValueError:
        return text


def _written(args, change: str) -> tuple[dict, object]:
    result = {"doc": args.doc, "change": change}
    return result, lambda: console().print(f"{args.doc}: change {change[:16]} stored", highlight=False)


def _info_table(info: dict) -> Table:
    table = rich_table(show_header=False, box=None)
    for key, value in info.items():
        table.add_row(key, ", ".join(value) if isinstance(value, list) else str(value))
    return table


async def cmd_ls(client: meshd.Client, args) -> object:
    rows = await client.documents()
    columns = ["doc", "changes", "heads", "pending", "writable", "public"]
    table = rich_table(title=f"{len(rows)} documents", title_justify="left")
    for col in columns + ["peers"]:
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(row[c]) for c in columns), str(len(row["peers"])))
    return rows, lambda: console().print(table)


async def cmd_create(client: meshd.Client, args) -> object:
    doc = await client.document(args.doc, create=True)
    if args.public:
        await doc.grant("anyone", "reader")
    info = await doc.info()
    return info, lambda: console().print(f"created {info['doc']}", highlight=False, soft_wrap=True)


async def cmd_info(client: meshd.Client, args) -> object:
    info = await (await client.document(args.doc)).info()
    return info, lambda: console().print(_info_table(info))


async def cmd_get(client: meshd.Client, args) -> object:
    value = await (await client.document(args.doc)).get(args.path)

    return value, lambda: console().print_json(to_json(value))  # the notation `crdt set` takes


async def cmd_set(client: meshd.Client, args) -> object:
    doc = await client.document(args.doc)
    op = "assign" if args.multi else "set"
    return _written(args, await doc.write([[op, split_path(args.path), _value(args.value)]]))


async def cmd_inc(client: meshd.Client, args) -> object:
    doc = await client.document(args.doc)
    op = "grow" if args.grow_only else "inc"
    return _written(args, await doc.write([[op, split_path(args.path), args.amount]]))


async def cmd_add(client: meshd.Client, args) -> object:
    doc = await client.document(args.doc)
    return _written(args, await doc.add(args.path, _element(args.elem)))


async def cmd_rm(client: meshd.Client, args) -> object:
    doc = await client.document(args.doc)
    if args.elem is None:
        return _written(args, await doc.delete(args.path))
    return _written(args, await doc.remove(args.path, _element(args.elem)))


async def cmd_grant(client: meshd.Client, args) -> object:
    doc = await client.document(args.doc)
    method = doc.revoke if args.revoke else doc.grant
    return _written(args, await method(args.key, args.role))


async def cmd_sync(client: meshd.Client, args) -> object:
    result = await (await client.document(args.doc)).sync(args.peer)
    rows = [{"peer": peer, **stats} for peer, stats in result.items()]
    table = rich_table(title=f"synced {args.doc} with {len(rows)} peers", title_justify="left")
    columns = ("peer", "sent", "received", "rounds", "error")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(row.get(c, "")) for c in columns))
    return result, lambda: console().print(table)


async def cmd_compact(client: meshd.Client, args) -> object:
    result = await client.request("crdt.compact", {"doc": args.doc})
    return result, lambda: console().print(f"{args.doc}: {result['folded']} changes folded into a snapshot")


async def cmd_forget(client: meshd.Client, args) -> object:
    result = await client.request("crdt.forget", {"doc": args.doc})
    return result, lambda: console().print(f"{result['forgotten']}: no longer kept here", highlight=False)


async def cmd_watch(client: meshd.Client, args) -> object:
    """Print each change as it is applied; stop after ``--count`` (default: never)."""
    doc = await client.document(args.doc)
    seen = 0
    async with doc.changes() as events:
        async for event in events:
            if args.json:
                print(to_json(event), flush=True)
            else:
                ops = "; ".join(" ".join(str(v) if k != "path" else "/".join(v) for k, v in o.items())
                                for o in event["ops"])
                console().print(f"{event['author'][:12]} {event['change'][:12]} {ops}", highlight=False)
            seen += 1
            if args.count and seen >= args.count:
                break
    return None, None


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    """The ``crdt`` command and its subcommands."""
    add_command = command_group(sub, common, "crdt", "replicated documents (CRDTs)", __doc__)

    def add(name: str, func, help: str, *, path: bool = False) -> argparse.ArgumentParser:
        p = add_command(name, func, help)
        if name != "ls":
            p.add_argument("doc")
        if path:
            p.add_argument("path")
        return p

    add("ls", cmd_ls, "documents this node keeps")
    add("create", cmd_create, "create a document owned by this node").add_argument(
        "--public", action="store_true", help="anyone may read it")
    add("info", cmd_info, "changes, replicas, writers and readers of a document")
    add("get", cmd_get, "the value of a document or of one path").add_argument("path", nargs="?", default="")
    p = add("set", cmd_set, "set a register", path=True)
    p.add_argument("value")
    p.add_argument("--multi", action="store_true", help="a multi-value register (keeps concurrent values)")
    p = add("inc", cmd_inc, "add to a counter", path=True)
    p.add_argument("amount", nargs="?", type=int, default=1)
    p.add_argument("--grow-only", action="store_true", help="a grow-only counter")
    add("add", cmd_add, "add an element to a set", path=True).add_argument("elem")
    add("rm", cmd_rm, "remove an element from a set, or (no ELEM) a map key", path=True).add_argument(
        "elem", nargs="?")
    p = add("grant", cmd_grant, "let a PeerId write (or read; 'anyone' reads a public document)")
    p.add_argument("key", help="PEERID, or 'anyone' with --role reader")
    p.add_argument("--role", choices=("writer", "reader"), default="writer")
    p.add_argument("--revoke", action="store_true", help="take the role away instead")
    add("watch", cmd_watch, "print changes as they arrive").add_argument(
        "--count", type=int, default=None, help="stop after this many (default: never)")
    add("sync", cmd_sync, "reconcile with one replica or all now").add_argument("peer", nargs="?")
    add("compact", cmd_compact, "fold the op log into a snapshot")
    add("forget", cmd_forget, "stop keeping a document and delete it here")
