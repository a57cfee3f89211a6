"""``meshctl learning ...`` (or ``learn``): the training groups this node is in.

A group is one training run (``group="run42"`` in ``meshd.learning.DiLoCo``
or ``GossipAverager``); members find each other through the DHT and say
hello every few seconds, so these tables show who is live, which round each
member is in, and whether their parameter hashes agree.  With the crdt
service on, members also keep entries in the group's membership document
(join time, role, throughput), so members that went quiet or left are listed
too.
"""

from __future__ import annotations

import argparse
import time

import meshd

from ..common import command_group, console, rows_table


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f}"


def _known(counts: dict | None) -> str | None:
    """The membership document's entries by state, as "2 live, 1 left" (None: no document)."""
    if counts is None:
        return None
    return ", ".join(f"{n} {state}" for state, n in counts.items() if n) or "none"


def _rate(value: float | None) -> str | None:
    return None if value is None else f"{value:,.1f}" if value else "-"


def _role(m: dict) -> str | None:
    if m.get("role") is None:
        return None
    island = m.get("island") or 1
    return m["role"] + (f", island of {island}" if island > 1 else "")


def _joined(when: float | None) -> str | None:
    return None if when is None else time.strftime("%m-%d %H:%M:%S", time.localtime(when))


def _membership_line(about: dict) -> str:
    """One line on the group's membership document: where it is, whether this member writes it."""
    if about["document"] is None:
        return about["note"] or "no membership document"
    line = f"membership document {about['document']} ({'writer' if about['writer'] else 'not a writer'})"
    if about["rejected"]:
        line += f"; {about['rejected']} entries rejected (not written by their own member)"
    return line + (f"; {about['note']}" if about["note"] else "")


def _trains(session: dict | None) -> str:
    """Who trains for this member: a script over the control socket (its syncs), or the node's own process."""
    if session is None:
        return "this process"
    memory = {"shared": ", shared memory", "socket": ", over the socket"}.get(session.get("memory"), "")
    return f"a client, {session['syncs']} syncs{memory}"


async def cmd_ls(client: meshd.Client, args) -> object:
    rows = await client.learning_groups()
    shown = [{**r, "in MB": _mb(r["bytes_in"]), "out MB": _mb(r["bytes_out"]),
              "states out MB": _mb(r.get("state_bytes_out", 0)),
              "hash": (r["hash"] or "-")[:12], "members (document)": _known(r.get("known")),
              "trained by": _trains(r.get("client"))} for r in rows]
    table = rows_table(f"{len(rows)} training groups", shown,
                       ["group", "algorithm", "rule", "round", "live", "members (document)", "in MB", "out MB",
                        "states out MB", "hash", "trained by"])
    return rows, lambda: console().print(table)


def _clipped(m: dict) -> str:
    """Rounds this node's rule clipped the member in, then what the other members' entries
    say together (clipped of used; how many of the live ones find it a suspect), and
    SUSPECT if this node or most of the others do."""
    text = str(m["clipped"])
    if m.get("group_used"):
        text += f" / {m['group_clipped']} of {m['group_used']}, suspect to {m['suspected_by']} of {m['voters']}"
    return text + ("  SUSPECT" if m.get("suspect") or m.get("group_suspect") else "")


async def cmd_status(client: meshd.Client, args) -> object:
    info = await client.learning_status(args.group)
    shown = [{**m, "peer": m["peer"][:16] + ("  (me)" if m["me"] else ""),
              "seen s ago": None if m["seen_ago"] is None else f"{m['seen_ago']:.1f}",
              "hash": (m["hash"] or "-")[:12],
              "clipped here / group": _clipped(m),
              "agrees": {True: "yes", False: "NO", None: "-"}[m["agrees"]],
              "role": _role(m), "joined": _joined(m.get("joined")), "samples/s": _rate(m.get("samples_s")),
              "steps/s": _rate(m.get("steps_s")), "entry": m.get("state")}
             for m in info["members"]]
    title = (f"group {info['group']}: {info['algorithm']}, rule {info['rule']}, round {info['round']}, "
             f"{len(info['members'])} members, this one trained by {_trains(info.get('client'))}")
    table = rows_table(title, shown, ["peer", "round", "seen s ago", "path", "samples", "clipped here / group",
                                      "hash", "agrees", "role", "joined", "samples/s", "steps/s", "entry"])
    line = _membership_line(info["membership"])

    def show() -> None:
        console().print(table)
        console().print(line, markup=False, highlight=False, soft_wrap=True)

    return info, show


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    """The ``learning`` command (also ``learn``) and its subcommands."""
    add = command_group(sub, common, "learning", "training groups: members, rounds, bytes, hashes",
                        __doc__, aliases=("learn",))
    add("ls", cmd_ls, "groups this node is in, their round, bytes moved and members the document knows")
    p = add("status", cmd_status, "one group's members: round, last seen, path, contribution, hash, "
                                  "and from the membership document: role, join time, throughput")
    p.add_argument("group")
