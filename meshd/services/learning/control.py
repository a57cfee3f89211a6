"""The ``learning.*`` control methods: the groups this node trains in."""

from __future__ import annotations

from collections import Counter

import trio

from ...identity import PeerId
from ...rpc import NotFound
from ...rpc.args import field


def _hex(value: bytes | None) -> str | None:
    return value.hex() if value else None


def _summary(group) -> dict:
    return {"group": group.name, "algorithm": group.algorithm, "rule": group.rule, "round": group.round,
            "live": len(group.live()), "bytes_in": sum(group.bytes_in.values()),
            "bytes_out": sum(group.bytes_out.values()), "hash": _hex(group.hash)}


def _members(group, host) -> list[dict]:
    """Each live member with what its hellos said; ``agrees`` compares its hash
    with the most common one of the newest round hashed."""
    now = trio.current_time()
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
            "suspect": key in group.suspects,
            "hash": _hex(hash_), "hash_round": hash_round,
            "agrees": None if majority is None or hash_round != newest else hash_ == majority,
        })
    return rows


def control_methods(learning) -> dict:
    """``learning.ls`` and ``learning.status``, bound to ``learning``, the node's
    :class:`~meshd.services.learning.Learning` service."""

    async def ls(arg, ctx):
        return [_summary(group) for group in learning.groups.values()]

    async def status(arg, ctx):
        name = field(arg, "group", str)
        group = learning.groups.get(name)
        if group is None:
            raise NotFound(f"this node is not in group {name!r:.60} (meshctl learning ls lists its groups)")
        return {**_summary(group), "members": _members(group, learning.host)}

    return {"learning.ls": ls, "learning.status": status}
