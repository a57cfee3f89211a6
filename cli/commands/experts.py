"""``meshctl experts ...``: the experts this node serves, any expert's servers, one call for debugging,
serving one from files.

Experts are torch modules that scripts serve on the mesh
(``meshd.experts.serve``), or the daemon serves from files (``serve``:
``meshctl experts serve model.safetensors --factory pkg.models:make --id
code-small --kind lm --domain code``; the daemon imports the factory and
torch then, and loads the weights without unpickling; ``unserve ID`` stops
it).  ``ls`` shows those this node serves, with
``--all`` every expert the registry document lists (``[experts] registry``),
and with ``--find ID`` where the DHT finds one; each with its servers'
health (ok, stale, backed-off, failing) and the latency this node measured
calling them (with ``--find``, an info round trip if it never called them).  ``call`` sends one request
through this node, e.g. ``meshctl experts call c0 '[[0.1, 0.2]]' '[0.5]'``
(one JSON array per input tensor, float32 unless ``--dtype`` says
otherwise; ``lm`` experts take ``--op score --dtype int64``).  No torch is
needed here: tensors are raw little-endian bytes, packed with ``array``.
"""

from __future__ import annotations

import argparse
import json
import os
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
    shown = [{**r, "servers": len(r.get("servers", [])), "health": _health(r), "latency": _latency(r),
              "model": _short(r.get("model")), "queued": (r.get("load") or {}).get("queued"),
              "calls": (r.get("load") or {}).get("calls"), "ms/batch": _ms((r.get("load") or {}).get("ms_per_batch"))}
             for r in rows]
    table = rows_table(f"{len(rows)} experts", shown,
                       ["expert", "kind", "domain", "params", "model", "servers", "health", "latency", "queued",
                        "calls", "ms/batch", "error"])
    return rows, lambda: console().print(table)


def _health(row: dict) -> str:
    """``ok`` when every server is; else the count of each health, best first (``1 ok, 1 stale``)."""
    peers = [p for p in row.get("peers") or [] if isinstance(p, dict)]
    counts: dict[str, int] = {}
    for word in ("ok", "backed-off", "failing", "stale"):
        n = sum(1 for p in peers if p.get("health") == word)
        if n:
            counts[word] = n
    if not counts:
        return row.get("health") or "-"
    if list(counts) == ["ok"]:
        return "ok"
    return ", ".join(f"{n} {word}" for word, n in counts.items())


def _latency(row: dict) -> str:
    """The lowest latency among the servers that are ok (``ping``: an info round trip just now), or -."""
    best = [p for p in row.get("peers") or [] if isinstance(p, dict) and p.get("health") == "ok"
            and isinstance(p.get("latency_ms"), (int, float))]
    if not best:
        return "-"
    fastest = min(best, key=lambda p: p["latency_ms"])
    return f"{fastest['latency_ms']:.1f} ms" + (" (ping)" if fastest.get("latency_from") == "ping" else "")


def _short(model) -> str | None:
    return model[:12] + "…" if isinstance(model, str) and len(model) > 13 else model


def _ms(value) -> str | None:
    return None if value is None else f"{value:.1f}"


async def cmd_serve(client: meshd.Client, args) -> object:
    if args.factory is not None:
        factory, weights = args.factory, os.path.abspath(args.source)
        if not os.path.isfile(weights):
            fail("meshctl", f"no weights file {args.source}", 2)
    elif ":" in args.source:
        factory, weights = args.source, None
    else:
        fail("meshctl", "serve a weights FILE with --factory MODULE:NAME, or a MODULE:NAME that builds the module", 2)
    module, colon, name = factory.rpartition(":")
    if not colon or not module or not name:
        fail("meshctl", f"a factory is MODULE:NAME (pkg.models:make or models.py:make), not {factory!r}", 2)
    if module.endswith(".py") or os.sep in module:  # a file: the daemon has another working directory
        factory = f"{os.path.abspath(module)}:{name}"
    try:
        kwargs = json.loads(args.kwargs) if args.kwargs else {}
    except json.JSONDecodeError as exc:
        fail("meshctl", f"--kwargs is a JSON object: {exc}", 2)
    if not isinstance(kwargs, dict):
        fail("meshctl", "--kwargs is a JSON object of the factory's keyword arguments", 2)
    info = await client.experts_serve(args.id, factory, weights, kwargs=kwargs, search=[os.getcwd()],
                                      kind=args.kind, domain=args.domain, dim=args.dim, max_batch=args.max_batch,
                                      max_wait_ms=args.max_wait_ms)

    def show() -> None:
        what = ", ".join(f"{k} {info[k]}" for k in ("kind", "domain", "params", "dim") if info.get(k) is not None)
        console().print(f"serving expert {args.id} ({what}) until `meshctl experts unserve {args.id}` "
                        f"or the daemon stops")

    return info, show


async def cmd_unserve(client: meshd.Client, args) -> object:
    result = await client.experts_unserve(args.expert)
    return result, lambda: console().print(f"expert {args.expert} is no longer served here")


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
    add = command_group(sub, common, "experts", "experts served on the mesh: ls, call, serve", __doc__)
    p = add("ls", cmd_ls, "experts this node serves (and, with --find, any expert's servers)")
    p.add_argument("--find", action="append", default=[], metavar="ID", help="also look this expert up (repeatable)")
    p.add_argument("--all", action="store_true", help="also every expert the registry document lists")
    p = add("call", cmd_call, "one call to an expert, for debugging")
    p.add_argument("expert")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="one JSON array per input tensor")
    p.add_argument("--op", default="forward", help="forward (default), or score for lm experts")
    p.add_argument("--dtype", default="float32", help="the inputs' dtype (default float32)")
    p.add_argument("--peer", help="ask this peer rather than the expert's first server")
    p = add("serve", cmd_serve, "have the daemon serve an expert from a weights file and a factory")
    p.add_argument("source", metavar="FILE", help="the weights (.safetensors, or a torch.save state_dict, read "
                   "weights-only); or MODULE:NAME, a factory that returns the module with its weights")
    p.add_argument("--factory", metavar="MODULE:NAME", help="what builds the module the weights go into: "
                   "pkg.models:make (imported from here or the daemon's path) or models.py:make")
    p.add_argument("--id", required=True, help="the expert's id")
    p.add_argument("--kind", default="module", choices=["module", "lm", "flow", "router"])
    p.add_argument("--domain", help="its domain or data cluster")
    p.add_argument("--dim", type=int, help="the vectors' size (flow, router), if the module has no dim attribute")
    p.add_argument("--kwargs", help="the factory's keyword arguments, a JSON object")
    p.add_argument("--max-batch", type=int, default=32, help="rows batched into one forward (default 32)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="how long a call may wait for a batch (default 5)")
    p = add("unserve", cmd_unserve, "stop serving an expert on the daemon")
    p.add_argument("expert")
