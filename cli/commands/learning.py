"""``meshctl learning ...`` (or ``learn``): the training groups this node is in.

A group is one training run (``group="run42"`` in ``meshd.learning.DiLoCo``
or ``GossipAverager``); members find each other through the DHT and say
hello every few seconds, so these tables show who is live, which round each
member is in, and whether their parameter hashes agree.
"""

from __future__ import annotations

import argparse

import meshd

from ..common import command_group, console, rows_table


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f}"


async def cmd_ls(client: meshd.Client, args) -> object:
    rows = await client.learning_groups()
    shown = [{**r, "in MB": _mb(r["bytes_in"]), "out MB": _mb(r["bytes_out"]),
              "hash": (r["hash"] or "-")[:12]} for r in rows]
    table = rows_table(f"{len(rows)} training groups", shown,
                       ["group", "algorithm", "rule", "round", "live", "in MB", "out MB", "hash"])
    return rows, lambda: console().print(table)


async def cmd_status(client: meshd.Client, args) -> object:
    info = await client.learning_status(args.group)
    shown = [{**m, "peer": m["peer"][:16] + ("  (me)" if m["me"] else ""),
              "seen s ago": f"{m['seen_ago']:.1f}", "hash": (m["hash"] or "-")[:12],
              "clipped": f"{m['clipped']}{'  SUSPECT' if m.get('suspect') else ''}",
              "agrees": {True: "yes", False: "NO", None: "-"}[m["agrees"]]}
             for m in info["members"]]
    title = (f"group {info['group']}: {info['algorithm']}, rule {info['rule']}, round {info['round']}, "
             f"{len(info['members'])} members")
    table = rows_table(title, shown, ["peer", "round", "seen s ago", "path", "samples", "clipped",
                                      "hash", "agrees"])
    return info, lambda: console().print(table)


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    """The ``learning`` command (also ``learn``) and its subcommands."""
    add = command_group(sub, common, "learning", "training groups: members, rounds, bytes, hashes",
                        __doc__, aliases=("learn",))
    add("ls", cmd_ls, "groups this node is in, their round and bytes moved")
    p = add("status", cmd_status, "one group's members: round, last seen, path, contribution, hash")
    p.add_argument("group")
