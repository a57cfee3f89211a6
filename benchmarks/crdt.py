"""CRDT benchmark: local operation rates, sync bytes, and convergence across real daemons.

    .venv/bin/python benchmarks/crdt.py [--quick] [--daemons 10] [--writes 1000] [--runs 3]

One table, about 40 s on 2 cores (``--quick``: 10 s), every number measured in this run:

1. Local operations/s through the library by type (Transaction, Document.prepare, which signs,
   Document.receive, which applies; 1,000 ops per change), one op per change, and with
   Store.save (SQLite, synchronous=FULL) per change; pycrdt's map sets beside them.
2. Bytes to sync two replicas of a 10,000-key map after 1 % of it changed: reconciliation
   messages plus change batches, as meshd sends them, against the differing changes' own bytes
   and pycrdt's ``get_update(state_vector)``.
3. Real daemons on 127.0.0.1: node 0 creates a document, grants the others as writers, they open
   it and watch it; a burst of one-op crdt.write calls spread over the nodes; time from the last
   acknowledgement until every node's watch stream delivered every write; write latency.

Targets: >= 50,000 local map sets/s; sync bytes <= 2x the differing changes; convergence <= 1 s.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import msgpack
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from pycrdt import Doc, Map
from rich.console import Console
from rich.table import Table

# The repo, not this folder, comes first: this file would shadow the crdt package.
REPO = Path(__file__).resolve().parent.parent
sys.path[:1] = [str(REPO)]
import meshd  # noqa: E402
from benchmarks.dht import pct, start_daemons, wait_for_routing  # noqa: E402
from benchmarks.parts import log, run_parts, stop_on_sigterm  # noqa: E402
from crdt.change import decode_change  # noqa: E402
from crdt.document import Document  # noqa: E402
from crdt.reconcile import ItemSet, Reconciler  # noqa: E402
from crdt.store import Store  # noqa: E402
from meshd.testing.localmesh import Daemon  # noqa: E402

TX = 1_000  # operations per transaction
TARGET_SETS, TARGET_RATIO, TARGET_CONVERGE_MS = 50_000, 2.0, 1_000.0


def new_key() -> tuple[bytes, object]:
    key = Ed25519PrivateKey.generate()
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw), key.sign


def commit(doc: Document, author: bytes, sign, fill, store: Store | None = None):
    """One change as an application makes it: record, sign, (store,) apply."""
    tx = doc.transaction()
    fill(tx)
    change = doc.prepare(tx, author, sign, int(time.time() * 1000))
    if store is not None:
        store.save(doc, [change])
    doc.receive(change)
    return change


# ============================================================== 1. local operations

LOCAL = [  # label, op, untimed setup op (same i), transaction size, share of --ops
    ("LWW map sets", lambda tx, i: tx.set([f"k{i}"], i), None, TX, 1),
    ("MV register assigns", lambda tx, i: tx.assign([f"k{i}"], i), None, TX, 1),
    ("PN-counter incs (1,000 counters)", lambda tx, i: tx.inc([f"c{i % 1000}"], 1), None, TX, 1),
    ("grow-only counter incs", lambda tx, i: tx.inc([f"c{i % 1000}"], 1, grow_only=True), None, TX, 1),
    ("set adds (one set)", lambda tx, i: tx.add(["s"], i), None, TX, 2),  # half: each op scans the set
    ("set removes (one set)", lambda tx, i: tx.remove(["s"], i), lambda tx, i: tx.add(["s"], i), TX, 2),
    ("nested map sets (path depth 3)", lambda tx, i: tx.set(["a", f"b{i % 10}", f"k{i}"], i), None, TX, 1),
    ("map key deletes", lambda tx, i: tx.delete([f"k{i}"]), lambda tx, i: tx.set([f"k{i}"], i), TX, 1),
    ("map sets, 1 op per change", lambda tx, i: tx.set([f"k{i}"], i), None, 1, 4),
]


def local_rate(n: int, op, setup=None, per_tx: int = TX, db: Path | None = None) -> float:
    author, sign = new_key()
    doc, store = Document(author, "bench"), db and Store(db)
    batches = [range(s, min(n, s + per_tx)) for s in range(0, n, per_tx)]
    for batch in batches if setup else ():
        commit(doc, author, sign, lambda tx: [setup(tx, i) for i in batch])
    t0 = time.perf_counter()
    for batch in batches:
        commit(doc, author, sign, lambda tx: [op(tx, i) for i in batch], store)
    rate = n / (time.perf_counter() - t0)
    if store:
        store.close()
    return rate


def pycrdt_rate(n: int) -> float:
    doc = Doc()
    m = doc.get("m", type=Map)
    t0 = time.perf_counter()
    for s in range(0, n, TX):
        with doc.transaction():
            for i in range(s, min(n, s + TX)):
                m[f"k{i}"] = i
    return n / (time.perf_counter() - t0)


def local_rows(n: int, tmp: Path) -> list[list]:
    rows = []
    for label, op, setup, per_tx, share in LOCAL:
        count = n // share
        rate = local_rate(count, op, setup, per_tx)
        is_set = label.startswith("LWW")
        rows.append(["local, crdt", label, rate, "ops/s", f"≥ {TARGET_SETS:,}" if is_set else "",
                     rate >= TARGET_SETS if is_set else None,
                     f"{count:,} ops" + (", 1,000-op transactions" if per_tx > 1 else " = changes")
                     + (f"; the set holds up to {count:,}" if "(one set)" in label else "")])
    rate = local_rate(n, LOCAL[0][1], db=tmp / "local.sqlite")
    rows.append(["local, crdt", "map sets durable (SQLite FULL)", rate, "ops/s", "", None,
                 f"{n:,} ops, 1,000-op transactions, Store.save per change"])
    rows.append(["local, pycrdt", "map sets", pycrdt_rate(n), "ops/s", "", None,
                 f"{n:,} ops, 1,000 per doc.transaction(); no signing, no storage"])
    return rows


# ============================================================== 2. sync bytes


def session(a: Document, b: Document, wires: dict[bytes, bytes]) -> dict:
    """One crdt.sync session, B initiating; both replicas are brought up to date."""
    ra, rb = Reconciler(ItemSet(a.items)), Reconciler(ItemSet(b.items))
    message, receiver, other, recon, messages = rb.initiate(), ra, rb, 0, 0
    while message is not None:
        recon += len(msgpack.packb(message, use_bin_type=True))
        messages += 1
        message = receiver.receive(msgpack.unpackb(msgpack.packb(message, use_bin_type=True)))
        receiver, other = other, receiver
    assert ra.done and rb.done and ra.have == rb.need and rb.have == ra.need
    sent = 0
    for mine, peer in ((ra.have, b), (rb.have, a)):
        batch = [wires[k] for k in sorted(mine)]  # one frame: far below meshd's 4 MiB per batch
        sent += len(msgpack.packb(batch, use_bin_type=True)) if batch else 0
        for wire in batch:
            peer.receive(decode_change(wire))
    diff = sum(len(wires[k]) for k in ra.have | rb.have)
    assert a.get() == b.get(), "replicas differ after the session"
    return {"recon": recon, "sent": sent, "total": recon + sent, "diff": diff, "messages": messages,
            "changes": len(ra.have | rb.have)}


def sync_case(name: str, seed: int) -> dict:
    """A 10,000-key map on A and B (and in two pycrdt docs), then ``name``'s edits, then a sync."""
    rng = random.Random(seed)
    (ka, sa), (kb, sb) = new_key(), new_key()
    a, b, wires = Document(ka, "sync"), Document(ka, "sync"), {}
    ya, yb = Doc(), Doc()
    ma, mb = ya.get("m", type=Map), yb.get("m", type=Map)

    def edit(doc, key, sign, ydoc, ymap, items):
        change = commit(doc, key, sign, lambda tx: [tx.set([k], v) for k, v in items])
        wires[change.key] = change.wire
        with ydoc.transaction():
            for k, v in items:
                ymap[k] = v
        return change

    b.receive(commit(a, ka, sa, lambda tx: tx.grant(kb)))
    for t in range(10):
        b.receive(edit(a, ka, sa, ya, ma, [(f"k{i}", i) for i in range(t * TX, (t + 1) * TX)]))
    yb.apply_update(ya.get_update())
    keys = [f"k{i}" for i in rng.sample(range(10 * TX), 100)]
    if name == "one":
        edit(a, ka, sa, ya, ma, [(k, -1) for k in keys])
    else:
        for n, k in enumerate(keys):
            if name == "many" or n % 2 == 0:
                edit(a, ka, sa, ya, ma, [(k, -1)])
            else:
                edit(b, kb, sb, yb, mb, [(k, -2)])
    sva, svb = ya.get_state(), yb.get_state()
    upd_ab, upd_ba = ya.get_update(svb), yb.get_update(sva)
    res = session(a, b, wires)
    res["pycrdt"] = len(upd_ab) + (len(upd_ba) if name == "both" else 0)
    res["pycrdt_sv"] = len(svb) + (len(sva) if name == "both" else 0)
    yb.apply_update(upd_ab)
    ya.apply_update(upd_ba)
    assert ma.to_py() == mb.to_py() == {k: v for k, v in a.get().items()}, "pycrdt and crdt disagree"
    return res


SYNC_CASES = [("many", "sync, 1%: 100 changes"), ("one", "sync, 1%: 1 change of 100 ops"),
              ("both", "sync, 50 + 50 concurrent")]


def sync_rows() -> list[list]:
    rows = []
    for seed, (name, part) in enumerate(SYNC_CASES):
        r = sync_case(name, seed)
        ratio = r["total"] / r["diff"]
        what = {"many": "A changed 100 of the keys, one change each", "one": "A changed 100 keys in one change",
                "both": "A and B each changed 50 other keys, one change each"}[name]
        rows += [[part, "meshd sync session", r["total"], "B", f"≤ {TARGET_RATIO:g}× changes", ratio <= TARGET_RATIO,
                  f"{ratio:.2f}× the differing changes: reconciliation {r['recon']:,} B in {r['messages']} "
                  f"messages + change batches {r['sent']:,} B"],
                 [part, "differing changes", r["diff"], "B", "", None,
                  f"{what}: {r['changes']} signed change{'s' * (r['changes'] != 1)}, wire bytes"],
                 [part, "pycrdt update", r["pycrdt"], "B", "", None,
                  f"get_update(state vector){' both ways' if name == 'both' else ''}, "
                  f"plus {r['pycrdt_sv']} B of state vector{'s' * (name == 'both')}"]]
    return rows


# ============================================================== 3. real daemons


class Watch:
    """Per node, how many changes of each tag (first key of the first op's path) its watch stream
    delivered; ``expect(tag, count)`` gives an event set once every node has delivered ``count``."""

    def __init__(self, nodes: int):
        self.nodes, self.counts, self.want = nodes, [{} for _ in range(nodes)], {}

    def expect(self, tag: str, count: int) -> tuple[trio.Event, dict]:
        self.want[tag] = (count, trio.Event(), {})  # when: node -> time it had them all
        return self.want[tag][1:]

    async def follow(self, node: int, doc, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with doc.changes() as events:
            task_status.started()  # the daemon has subscribed this stream
            async for event in events:
                tag = event["ops"][0]["path"][0]
                self.counts[node][tag] = seen = self.counts[node].get(tag, 0) + 1
                count, done, when = self.want.get(tag, (None, None, None))
                if seen == count:
                    when[node] = time.perf_counter()
                    if len(when) == self.nodes:
                        done.set()


async def _daemons(daemons: list[Daemon], args) -> dict:
    n, res = len(daemons), {"lat": [], "runs": []}
    async with AsyncExitStack() as stack:
        stack.enter_context(trio.fail_after(args.timeout))
        clients = [await stack.enter_async_context(meshd.connect(d.data_dir)) for d in daemons]
        owner = await clients[0].document("bench", create=True)
        if n > 1:
            await owner.write([["grant", d.peer_id, "writer"] for d in daemons[1:]])
        docs = [owner] + [await c.document(f"{daemons[0].peer_id}/bench") for c in clients[1:]]
        for doc in docs[1:]:  # make sure each replica knows node 0 (and node 0 knows it)
            await doc.sync(daemons[0].peer_id)
        res["peers"] = [len((await doc.info())["peers"]) for doc in docs]
        watch = Watch(n)
        nursery = await stack.enter_async_context(trio.open_nursery())
        for i, doc in enumerate(docs):
            await nursery.start(watch.follow, i, doc)
        for run in range(-1, args.runs):  # run -1 warms the push paths up and is not reported
            tag, count = (f"burst{run}", args.writes) if run >= 0 else ("warm", n)
            done, when = watch.expect(tag, count)
            lat, acks = [], []

            async def writer(node: int, jobs: list[int]) -> None:
                for j in jobs:
                    op = ["inc", [tag, "total"], 1] if j % 2 == 0 else ["set", [tag, f"w{j}"], j]
                    t0 = time.perf_counter()
                    await docs[node].write([op])
                    acks.append(time.perf_counter())
                    lat.append(acks[-1] - t0)

            start = time.perf_counter()
            async with trio.open_nursery() as burst:
                for node in range(n):
                    for w in range(args.inflight):
                        burst.start_soon(writer, node, list(range(node, count, n))[w::args.inflight])
            await done.wait()
            totals = {await doc.get([tag, "total"]) for doc in docs}
            assert totals == {(count + 1) // 2}, f"counter totals differ: {totals}"
            last_ack, last_seen = max(acks), max(when.values())
            log(f"[daemons] {tag}: {count} writes acknowledged in {last_ack - start:.2f} s, "
                f"all {n} nodes saw them {last_seen - last_ack:.3f} s after the last ack")
            if run >= 0:
                res["lat"] += lat
                res["runs"].append((last_ack - start, last_seen - start))
        nursery.cancel_scope.cancel()
    return res


def daemon_rows(args, tmp: Path) -> list[list]:
    started: list[Daemon] = []
    try:
        t0 = time.perf_counter()
        daemons = start_daemons(tmp / "mesh", args.daemons, started)
        sizes, _ = wait_for_routing(daemons, 30.0, stable_s=1.0)
        log(f"[daemons] {args.daemons} up in {time.perf_counter() - t0:.1f} s; routing {min(sizes)}-{max(sizes)}")
        res = trio.run(_daemons, daemons, args)
    finally:
        for d in started:
            d.kill()
            if d.proc is not None and d.proc.stdout is not None:
                d.proc.stdout.close()
    conv = statistics.median(max(0.0, seen - acked) for acked, seen in res["runs"]) * 1e3
    burst = statistics.median(seen for _, seen in res["runs"])
    runs = "; ".join(f"acks {a:.2f} s, +{(s - a) * 1e3:.0f} ms" for a, s in res["runs"])
    part = f"meshd, {args.daemons} daemons"
    return [
        [part, "convergence after the last ack", conv, "ms", f"≤ {TARGET_CONVERGE_MS:g} ms",
         conv <= TARGET_CONVERGE_MS, f"median of {args.runs} runs ({runs}); seen on every node's crdt.watch"],
        [part, "burst start → all nodes have all", burst * 1e3, "ms", "", None,
         f"{args.writes:,} writes, {args.inflight} in flight per node; {args.writes / burst:.0f} writes/s"],
        [part, "write latency p50", pct(res["lat"], 50) * 1e3, "ms", "", None,
         "crdt.write of one inc/set via the control socket, acked once on disk"],
        [part, "write latency p95", pct(res["lat"], 95) * 1e3, "ms", "", None,
         f"{len(res['lat']):,} writes; replicas known per node {res['peers']}"],
    ]


# ============================================================== output


def print_table(rows: list[list], title: str) -> None:
    table = Table(title=title)
    for col in ("part", "measure", "value", "unit", "target", "detail"):
        table.add_column(col, justify="right" if col == "value" else "left")
    last = None
    for part, measure, value, unit, target, met, detail in rows:
        if last is not None and part.split(",")[0] != last:
            table.add_section()
        last = part.split(",")[0]
        if met is not None:
            target = f"{target} [green]met[/]" if met else f"{target} [red]MISSED[/]"
        shown = "-" if value is None else f"{value:,.1f}" if unit == "ms" else f"{value:,.0f}"
        table.add_row(part, measure, shown, unit, target, detail)
    Console(width=200).print(table)
    print("ops/s: operations recorded, signed and applied per second of wall time, one process.  B: bytes\n"
          "as msgpack (RPC frame headers left out).  Convergence: from the acknowledgement of the burst's\n"
          "last write until every node's watch stream has delivered all of the burst's writes.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="5,000 local ops; 4 daemons, 200 writes, 1 run")
    parser.add_argument("--ops", type=int, default=20_000, help="local operations per row")
    parser.add_argument("--daemons", type=int, default=10)
    parser.add_argument("--writes", type=int, default=1_000, help="writes per burst")
    parser.add_argument("--runs", type=int, default=3, help="bursts; the median is reported")
    parser.add_argument("--inflight", type=int, default=4, help="concurrent writes per node")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for the whole daemon part")
    parser.add_argument("--skip", default="", help="comma list of: local, sync, daemons")
    args = parser.parse_args()
    if args.quick:
        args.ops, args.daemons, args.writes, args.runs = 5_000, 4, 200, 1
    os.chdir(REPO)  # the daemons run `python -m`, which puts the working directory first on sys.path
    stop_on_sigterm()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="meshd-crdt-bench-") as tmp:
        parts = [("local", lambda: local_rows(args.ops, Path(tmp))), ("sync", sync_rows),
                 ("daemons", lambda: daemon_rows(args, Path(tmp)))]
        rows, rc = run_parts(parts, args.skip,
                             lambda name, message: [name, "FAILED", None, "", "", False, message],
                             ["interrupted", "(the rows above are all there is)", None, "", "", None, ""])
    print_table(rows, f"CRDT: local operations, sync bytes, {args.daemons} daemons on 127.0.0.1 "
                      f"({os.cpu_count()} CPUs; run took {time.perf_counter() - t0:.0f} s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
