"""The ``learning.*`` control methods: the groups this node trains in.

A group's rows join two sources: what members' hellos say (round, last heard,
path, hash) for the members live now, and what the group's membership
document says (join time, role, throughput, the round it wrote, live, quiet
or left) for every member it holds an entry of, gone ones included.
"""

from __future__ import annotations

from collections import Counter

import trio

from learn.membership import clipped_by_group, suspect_of_group

from ...identity import PeerId
from ...rpc import NotFound
from ...rpc.args import field
from ...service import Method


def _hex(value: bytes | None) -> str | None:
    return value.hex() if value else None


def _summary(group, membership, session, rows: dict | None = None, rejected: int = 0) -> dict:
    """One group in brief; ``known`` counts the membership document's entries by state
    (None without a document); ``client``: the session of the training script (over the
    control socket) this member trains for, None for a script in the node's own process."""
    about = membership.summary(rows, rejected)
    return {"group": group.name, "algorithm": group.algorithm, "rule": group.rule, "round": group.round,
            "live": len(group.live()), "bytes_in": sum(group.bytes_in.values()),
            "bytes_out": sum(group.bytes_out.values()), "state_bytes_out": sum(group.state_bytes_out.values()),
            "hash": _hex(group.hash),
            "known": about["entries"] if about["document"] is not None else None,
            "client": session.status() if session is not None else None}


_NO_ENTRY = {"joined": None, "role": None, "island": None, "samples_s": None, "steps_s": None,
             "doc_round": None, "doc_seen": None, "state": None}


def _entry_fields(row: dict | None) -> dict:
    """A member's fields from the membership document (all None without an entry)."""
    if row is None:
        return dict(_NO_ENTRY)
    return {"joined": row["joined"], "role": row["role"], "island": row["island"], "samples_s": row["samples_s"],
            "steps_s": row["steps_s"], "doc_round": row["round"], "doc_seen": row["seen"], "state": row["state"]}


def _group_clipped(by_group: dict, live: set[str], peer: str) -> dict:
    """What the membership document's entries say together of ``peer``'s contributions:
    rounds clipped and used, summed over the other members' entries, how many of
    those find it a suspect (``suspected_by``) of how many live ones (``voters``: the
    ``live`` entries' authors but itself),
    and whether that makes it the group's suspect."""
    clipped, used, by = by_group.get(peer, (0, 0, 0))
    voters = len(live - {peer})
    return {"group_clipped": clipped, "group_used": used, "suspected_by": by, "voters": voters,
            "group_suspect": suspect_of_group(by, voters)}


def _members(group, host, membership, entries: dict[str, dict]) -> list[dict]:
    """Each live member with what its hellos said, then each member only the membership
    document knows (quiet or gone), every row with the document's fields
    (:func:`_entry_fields`); ``agrees`` compares a live member's hash with the most
    common one of the newest round hashed."""
    now = trio.current_time()
    by_group = clipped_by_group(entries)
    live_entries = {author for author, row in entries.items() if row["state"] == "live"}
    infos = {m.peer: m for m in (group.view.members.get(k) for k in group.live()) if m is not None}
    hashes = {k: (m.hash_round, m.hash) for k, m in infos.items()}
    hashes[group.me] = (group.hash_round, group.hash)
    newest = max(r for r, _ in hashes.values())
    votes = Counter(h for r, h in hashes.values() if r == newest and h)
    majority = votes.most_common(1)[0][0] if votes else None
    rows = []
    for key in group.live():
        member = infos.get(key)
        hash_round, hash_ = hashes[key]
        conn = host.live(PeerId(key)) if key != group.me else None
        rows.append({
            "peer": str(PeerId(key)), "me": key == group.me,
            "round": group.round if key == group.me else member.round,
            "seen_ago": 0.0 if key == group.me else max(0.0, now - member.last_seen),
            "path": "self" if key == group.me else (conn.path if conn is not None else None),
            "samples": group.samples.get(key, 0), "clipped": group.clipped.get(key, 0),
            "suspect": key in group.suspects, **_group_clipped(by_group, live_entries, str(PeerId(key))),
            "hash": _hex(hash_), "hash_round": hash_round,
            "agrees": None if majority is None or hash_round != newest else hash_ == majority,
            **_entry_fields(entries.get(str(PeerId(key)))),
        })
    mine = next(row for row in rows if row["me"])
    if mine["role"] is None:  # no entry of its own (yet): what this member measures of itself
        mine.update(role=membership.role, island=membership.island, joined=membership.joined,
                    samples_s=membership.meter.samples_s, steps_s=membership.meter.steps_s)
    shown = {row["peer"] for row in rows}
    for peer, entry in sorted(entries.items(), key=lambda item: (item[1]["state"] == "left", item[0])):
        if peer not in shown:
            key = PeerId.from_string(peer).key
            rows.append({"peer": peer, "me": False, "round": None, "seen_ago": None, "path": None,
                         "samples": group.samples.get(key, 0), "clipped": group.clipped.get(key, 0),
                         "suspect": key in group.suspects, **_group_clipped(by_group, live_entries, peer),
                         "hash": None, "hash_round": None, "agrees": None,
                         **_entry_fields(entry)})
    return rows


def control_methods(learning) -> dict:
    """``learning.ls`` and ``learning.status``, bound to ``learning``, the node's
    :class:`~meshd.services.learning.Learning` service; and ``learning.session``, a
    training script's session (bidirectional, :mod:`.sessions`)."""

    async def ls(arg, ctx):
        return [_summary(group, learning.memberships[name], learning.sessions.get(name))
                for name, group in learning.groups.items()]

    async def status(arg, ctx):
        name = field(arg, "group", str)
        group = learning.groups.get(name)
        if group is None:
            raise NotFound(f"this node is not in group {name!r:.60} (meshctl learning ls lists its groups)")
        membership = learning.memberships[name]
        entries, rejected = membership.entries()
        return {**_summary(group, membership, learning.sessions.get(name), entries, rejected),
                "membership": membership.summary(entries, rejected),
                "members": _members(group, learning.host, membership, entries)}

    async def session(channel, ctx):
        from .sessions import serve_session  # torch, only once a script opens a session

        await serve_session(learning, channel, ctx)

    return {"learning.ls": ls, "learning.status": status, "learning.session": Method(session, "bidi")}
