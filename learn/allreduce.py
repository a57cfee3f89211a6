"""How an all-reduce is cut among its members.

The flattened vector (every tensor in name order, float32) is cut into one
contiguous slice per member of the sorted member list; member i reduces
slice i of every contributor's vector, in contributor order, and sends the
result to all, so each slice is reduced exactly once and every member
receives the same values (bit for bit).  Each member sends and receives
(N−1)/N of the vector twice, as in a butterfly all-reduce.
"""

from __future__ import annotations


def partition(total: int, members: list[bytes]) -> list[tuple[int, int]]:
    """``[0, total)`` cut into ``len(members)`` contiguous (start, end) ranges
    whose sizes differ by at most one, in member order."""
    if not members:
        raise ValueError("an all-reduce needs at least one member")
    base, extra = divmod(total, len(members))
    ranges, at = [], 0
    for i in range(len(members)):
        size = base + (i < extra)
        ranges.append((at, at + size))
        at += size
    return ranges
