"""``meshctl experts ...``: the experts this node serves, any expert's servers, one call for debugging.

Experts are torch modules that scripts serve on the mesh
(``meshd.experts.serve``); ``ls`` shows those this node serves, with
``--all`` every expert the registry document lists (``[experts] registry``),
and with ``--find ID`` where the DHT finds one.  ``call`` sends one request
through this node, e.g. ``meshctl experts call c0 '[[0.1, 0.2]]' '[0.5]'``
(one JSON array per input tensor, float32 unless ``--dtype`` says
otherwise; ``lm`` experts take ``--op score --dtype int64``).  No torch is
needed here: tensors are raw little-endian bytes, packed with ``array``.
"""

from __future__ import annotations

import argparse
import json
import sys
from array import array

import meshd

from ..common import command_group, console, fail, rows_table

TYPECODES = {"float32": "f", "float64": "d", "int64": "q", "int32": "i", "int16": "h", "int8": "b",
             "uint8": "B", "bool": "B"}


def pack(text: str, dtype: str) -> dict:
    """A JSON array (nested lists of numbers, all rows alike) as a tensor map; one line and exit 2 if it is not."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        fail("meshctl", f"an input is a JSON array of numbers: {exc}", 2)
    shape, flat = [], value
    while isinstance(flat, list):
        shape.append(len(flat))
        flat = flat[0] if flat else None
    values: list = []

    def walk(node, depth: int) -> None:
        if depth == len(shape):
            if isinstance(node, list) or not isinstance(node, (int, float)):
                fail("meshctl", "an input's rows must all have the same shape, of numbers", 2)
            values.append(node)
            return
        if not isinstance(node, list) or len(node) != shape[depth]:
            fail("meshctl", "an input's rows must all have the same shape, of numbers", 2)
        for item in node:
            walk(item, depth + 1)

    walk(value, 0)
    try:
        data = array(TYPECODES[dtype], [int(v) if TYPECODES[dtype] not in "fd" else v for v in values])
    except (OverflowError, ValueError) as exc:
        fail("meshctl", f"a value does not fit {dtype}: {exc}", 2)
    if sys.byteorder != "little":
        data.byteswap()
    return {"dtype": dtype, "shape": shape, "data": data.tobytes()}


def unpack(tensor: dict) -> list:
    """A tensor map as nested lists."""
    data = array(TYPECODES.get(tensor["dtype"], "B"))
    data.frombytes(tensor["data"] if tensor["dtype"] in TYPECODES else b"")
    if sys.byteorder != "little":
        data.byteswap()
    values: list = data.tolist()
    for size in reversed(tensor["shape"][1:]):
        values = [values[i:i + size] for i in range(0, len(values), size)]
    return values


async def cmd_ls(client: meshd.Client, args) -> object:
    rows = await client.experts_ls(args.find, all=args.all)
    shown = [{**r, "servers": len(r.get("servers", [])), "stale": len(r.get("stale", [])) or "-",
              "queued": (r.get("load") or {}).get("queued"),
              "calls": (r.get("load") or {}).get("calls"), "ms/batch": _ms((r.get("load") or {}).get("ms_per_batch"))}
             for r in rows]
    table = rows_table(f"{len(rows)} experts", shown,
                       ["expert", "kind", "domain", "params", "model", "servers", "stale", "queued", "calls", "ms/batch",
                        "error"])
    return rows, lambda: console().print(table)


def _ms(value) -> str | None:
    return None if value is None else f"{value:.1f}"


async def cmd_call(client: meshd.Client, args) -> object:
    if args.dtype not in TYPECODES or args.dtype == "bool":
        fail("meshctl", f"--dtype is one of {', '.join(t for t in TYPECODES if t != 'bool')}", 2)
    inputs = [pack(text, args.dtype) for text in args.inputs]
    reply = await client.experts_call(args.expert, inputs, op=args.op, peer=args.peer)
    result = {"peer": reply["peer"], "ms": round(reply["ms"], 2), "batch": reply["batch"],
              "outputs": [{"dtype": o["dtype"], "shape": o["shape"], "values": unpack(o)} for o in reply["outputs"]]}

    def show() -> None:
        console().print(f"{args.expert} on {result['peer'][:16]}: {result['ms']} ms, batch of {result['batch']}")
        for i, o in enumerate(result["outputs"]):
            console().print(f"output {i}: {o['dtype']} {o['shape']}")
            console().print(json.dumps(o["values"])[:2000])

    return result, show


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    """The ``experts`` command and its subcommands."""
    add = command_group(sub, common, "experts", "experts served on the mesh: ls, call", __doc__)
    p = add("ls", cmd_ls, "experts this node serves (and, with --find, any expert's servers)")
    p.add_argument("--find", action="append", default=[], metavar="ID", help="also look this expert up (repeatable)")
    p.add_argument("--all", action="store_true", help="also every expert the registry document lists")
    p = add("call", cmd_call, "one call to an expert, for debugging")
    p.add_argument("expert")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="one JSON array per input tensor")
    p.add_argument("--op", default="forward", help="forward (default), or score for lm experts")
    p.add_argument("--dtype", default="float32", help="the inputs' dtype (default float32)")
    p.add_argument("--peer", help="ask this peer rather than the expert's first server")
