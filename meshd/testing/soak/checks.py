"""The checks at the end of a soak, each a :class:`Check` with a verdict and what it saw.

They run once the work and the chaos have stopped and every killed daemon is
back: every acknowledged document write on every replica (waiting, bounded,
for replication to converge), every acknowledged DHT key readable with a
value somebody put, every completed fetch byte-identical to what was
published, no process gone that the chaos did not kill, and every daemon's
peak memory under the bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

import meshd
from .mesh import MIB, Cluster, Slot
from .work import Ledger, chaos_errors


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class Convergence:
    """How long until every replica held every acknowledged write, and what was still missing."""

    seconds: float | None  # None: not within the bound
    missing: dict[str, int]  # slot name -> acknowledged elements it lacks (only those that lack some)
    torn: list[str]  # replicas whose counter disagrees with their set: a change applied in part


async def converge(cluster: Cluster, ledger: Ledger, timeout: float, poll: float = 0.5) -> Convergence:
    """Poll every live replica until its ``acked`` set holds every acknowledged element, ``timeout`` s at most."""
    began = trio.current_time()
    missing = {slot.name: len(ledger.acked) for slot in cluster.live()}
    torn: list[str] = []

    async def one(slot: Slot) -> None:
        while True:
            try:
                async with meshd.connect(slot.daemon.data_dir) as client:
                    value = await (await client.document(ledger.doc_ref)).get() or {}
            except chaos_errors():
                value = None
            if value is not None:
                have = set(value.get("acked") or [])
                missing[slot.name] = len(ledger.acked - have)
                if value.get("count", 0) != len(have) and slot.name not in torn:
                    torn.append(slot.name)
                if not missing[slot.name]:
                    return
            await trio.sleep(poll)

    with trio.move_on_after(timeout):
        async with trio.open_nursery() as nursery:
            for slot in cluster.live():
                nursery.start_soon(one, slot)
    lacking = {name: n for name, n in missing.items() if n}
    return Convergence(None if lacking else trio.current_time() - began, lacking, torn)


async def read_back_dht(cluster: Cluster, ledger: Ledger, timeout: float) -> tuple[int, int, list[str]]:
    """Get every acknowledged key on the seed: (keys found, keys with the last acknowledged value, lost keys)."""
    found = latest = 0
    lost = []
    async with meshd.connect(cluster.seed.daemon.data_dir) as client:
        for key, value in sorted(ledger.dht_acked.items()):
            record = None
            with trio.move_on_after(timeout):
                try:
                    record = await client.dht_get(key)
                except chaos_errors():
                    pass  # counted as lost below
            if record is None or record["value"] not in ledger.dht_written[key]:
                lost.append(key.decode())
                continue
            found += 1
            latest += record["value"] == value
    return found, latest, lost


def document_checks(cluster: Cluster, ledger: Ledger, conv: Convergence, timeout: float) -> list[Check]:
    replicas = len(cluster.live())
    written = ledger.tally("doc write").ok
    return [
        Check(f"{cluster.name}: acknowledged writes on every replica", conv.seconds is not None and written > 0,
              f"{len(ledger.acked)} writes on {replicas} replicas in {conv.seconds:.1f} s" if conv.seconds is not None
              else f"after {timeout:.0f} s still missing: {conv.missing}"),
        Check(f"{cluster.name}: each change applied whole", not conv.torn,
              "count == |acked| on every replica" if not conv.torn else f"torn on {conv.torn}"),
    ]


def dht_checks(cluster: Cluster, ledger: Ledger, found: int, latest: int, lost: list[str]) -> list[Check]:
    return [
        Check(f"{cluster.name}: acknowledged DHT keys readable", not lost and found > 0,
              f"{found} keys found ({latest} with the last acknowledged value)" + (f"; lost {lost}" if lost else "")),
        Check(f"{cluster.name}: no DHT get returned a value nobody put", not ledger.dht_foreign,
              f"{ledger.tally('dht get').ok} gets"
              + (f"; foreign {ledger.dht_foreign[:3]}" if ledger.dht_foreign else "")),
    ]


def fetch_checks(cluster: Cluster, ledger: Ledger) -> list[Check]:
    done = ledger.tally("fetch").ok
    verified = done - len(ledger.fetch_mismatches)
    return [Check(f"{cluster.name}: every completed fetch verified (sha256)", done > 0 and not ledger.fetch_mismatches,
                  f"{verified}/{done} fetches of {len(ledger.models)} versions"
                  + (f"; mismatched {ledger.fetch_mismatches[:3]}" if ledger.fetch_mismatches else ""))]


def process_checks(clusters: list[Cluster], rss_bound_mib: int) -> list[Check]:
    slots = [slot for cluster in clusters for slot in cluster.slots]
    crashed = {slot.name: slot.crashes for slot in slots if slot.crashes}
    down = [slot.name for slot in slots if not slot.up]
    peak = max(slots, key=lambda slot: slot.peak_rss)
    over = {slot.name: slot.peak_rss // MIB for slot in slots if slot.peak_rss > rss_bound_mib * MIB}
    return [
        Check("no daemon exited but those the chaos killed", not crashed,
              f"{len(slots)} daemons" if not crashed else f"crashed: {crashed}"),
        Check("every daemon running at the end", not down, f"down: {down}" if down else f"{len(slots)} running"),
        Check(f"peak RSS under {rss_bound_mib} MiB", not over,
              f"max {peak.peak_rss / MIB:.0f} MiB ({peak.name})" + (f"; over: {over}" if over else "")),
    ]
