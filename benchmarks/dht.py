"""DHT benchmark: the simulated network, real daemons on loopback, and the Lattica/hivemind anchors.

    .venv/bin/python benchmarks/dht.py [--skip sim,real,anchors] [--sizes 1000,10000]
                                       [--daemons 16,20] [--quorums default,1/1] [--ops 150] [--json FILE]

One run, one table (~5-6 min on 2 cores with the anchors):

1. Simulation (in-process, ``dht.simnet``; 5 ms one way under trio's MockClock, so virtual time
   counts round trips; routing tables filled with ``fill_tables``): per network size, lookup hops,
   messages per lookup and round trips per lookup (p50/p95/p99), then 300 keys put from random
   nodes, 30 % of the nodes marked dead, and each key fetched from a random live node.
2. Real ``meshd`` daemons on 127.0.0.1, all bootstrapped from the first: once every routing
   table is populated and a warm-up has opened the connections, put from a random daemon and
   get from another (latency through the control socket, p50/p95/p99); then SIGKILL 30 % of the
   daemons and get every key again from the survivors, twice.  Once with the default quorums (a
   put returns once 5 replicas stored, a get once 4 records came: the row with the targets), and
   once per other ``--quorums`` entry: 1/1 waits for what Lattica waits for (libp2p's
   Quorum::One, which Lattica's ``store`` and ``get`` use), the like-for-like row.
3. The Lattica and hivemind anchor scripts (``../shared/anchors``, DHT part only, same node
   counts, as many keys as ``--ops``), run as subprocesses in their own venvs; their store/get
   rows are printed beside ours.

Targets (printed beside the numbers): lookup <= 4 round trips at N = 10,000; with 16 daemons
get p50 <= 5 ms and put p50 <= 10 ms; >= 99.9 % of gets succeed with 30 % of the nodes dead, the
first pass after the kills with p95 <= 500 ms.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import trio
import trio.testing
from rich.console import Console
from rich.table import Table

# The repo, not this folder, comes first: benchmarks/nat.py would shadow the nat package.
_HERE = Path(__file__).resolve().parent
REPO = _HERE.parent
sys.path[:1] = [str(REPO)]
import meshd  # noqa: E402
from dht.ids import key_id  # noqa: E402
from dht.node import DhtConfig  # noqa: E402
from dht.simnet import SimNetwork, fill_tables, make_nodes  # noqa: E402
from benchmarks.parts import ANCHORS, log, run_anchor, run_parts, save_json, stop_on_sigterm  # noqa: E402
from meshd.control import socket_path  # noqa: E402
from meshd.testing.localmesh import Daemon, DaemonError  # noqa: E402

LATENCY = 0.005  # simulated one-way latency; a round trip is 10 ms of virtual time
RTT = 2 * LATENCY
DEAD_FRACTION = 0.3
VALUE_SIZE = 64  # bytes, as the anchor scripts store

TARGET_RTT_N, TARGET_RTT = 10_000, 4.0  # lookup round trips (p50) at this network size
TARGET_DAEMONS, TARGET_GET_MS, TARGET_PUT_MS = 16, 5.0, 10.0  # p50s with this many daemons, if no anchor ran
TARGET_SUCCESS = 0.999  # gets with 30 % of the nodes dead
TARGET_DEAD_P95_MS = 500.0  # the first pass of gets right after the kills


def pct(samples, p):
    """Nearest-rank percentile, the rule the anchor scripts use; None without samples."""
    xs = sorted(samples)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def _ms(samples, p):
    v = pct(samples, p)
    return None if v is None else v * 1e3


def row(system, measure, n, p50=None, p95=None, p99=None, success=None, target="", met=None,
        note="", unit="", kind=""):
    """One table row; ``met`` is None where the row has no target.  Real-daemon and anchor rows
    of the same ``kind`` (store, get, ...) and node count are printed next to each other."""
    return {"system": system, "measure": measure, "n": n, "p50": p50, "p95": p95, "p99": p99,
            "success": success, "unit": unit, "target": target, "met": met, "note": note, "kind": kind}


# ============================================================== 1. simulation


async def _simulate(n: int, lookups: int, keys: int, seed: int) -> dict:
    net = SimNetwork(latency=LATENCY)
    t0 = time.perf_counter()
    nodes = make_nodes(net, n, config=DhtConfig(request_timeout=0.1), seed=seed)
    fill_tables(nodes, seed=seed)
    setup_s = time.perf_counter() - t0
    rng = random.Random(seed)
    hops, msgs, rtts = [], [], []
    stored, got, get_rtts = [], 0, []
    async with trio.open_nursery() as nursery:
        for node in nodes:
            node.start(nursery)
        for i in range(lookups):
            src = rng.choice(nodes)
            sent, start = src.messages_sent, trio.current_time()
            lookup = await src.lookup(key_id(b"bench-lookup-%d" % i))
            rtts.append((trio.current_time() - start) / RTT)
            msgs.append(src.messages_sent - sent)
            hops.append(lookup.hops())
        names = [b"/open/bench-churn-%d" % i for i in range(keys)]
        for key in names:
            stored.append(await rng.choice(nodes).put(key, key + b"-value"))
        net.dead.update(node.public_key for node in rng.sample(nodes, round(n * DEAD_FRACTION)))
        alive = [node for node in nodes if node.public_key not in net.dead]
        for key in names:
            start = trio.current_time()
            record = await rng.choice(alive).get(key)
            get_rtts.append((trio.current_time() - start) / RTT)
            got += record is not None and record.value == key + b"-value"
        nursery.cancel_scope.cancel()
    return {"nodes": n, "lookups": lookups, "keys": keys, "setup_s": setup_s,
            "hops": hops, "messages": msgs, "round_trips": rtts, "put_replicas": stored,
            "dead": round(n * DEAD_FRACTION), "get_ok": got, "get_round_trips_dead": get_rtts}


def sim_rows(sizes: list[int], lookups: int, keys: int, results: dict) -> list[dict]:
    rows = []
    sysname = "meshd DHT, simulated"
    for n in sizes:
        log(f"[sim] N={n:,}: {lookups} lookups, {keys} puts, {keys} gets with 30% dead ...")
        t0 = time.perf_counter()
        res = trio.run(_simulate, n, lookups, keys, n, clock=trio.testing.MockClock(autojump_threshold=0))
        res["wall_s"] = time.perf_counter() - t0
        results.setdefault("sim", []).append(res)
        log(f"[sim] N={n:,} done in {res['wall_s']:.1f} s")
        rows.append(row(sysname, "lookup hops", n, pct(res["hops"], 50), pct(res["hops"], 95),
                        pct(res["hops"], 99), note=f"{lookups} FIND_NODE lookups from random nodes"))
        rows.append(row(sysname, "messages per lookup", n, pct(res["messages"], 50),
                        pct(res["messages"], 95), pct(res["messages"], 99), note="sent by the looking node"))
        p50 = pct(res["round_trips"], 50)
        target, met = "", None
        if n == TARGET_RTT_N:
            target, met = f"p50 ≤ {TARGET_RTT:g}", p50 <= TARGET_RTT
        rows.append(row(sysname, "round trips per lookup", n, p50, pct(res["round_trips"], 95),
                        pct(res["round_trips"], 99), target=target, met=met,
                        note="virtual time / (2 × 5 ms)"))
        ok = res["get_ok"] / keys
        rows.append(row(sysname, "get round trips, 30% dead", n, pct(res["get_round_trips_dead"], 50),
                        pct(res["get_round_trips_dead"], 95), pct(res["get_round_trips_dead"], 99),
                        success=ok, target=f"≥ {TARGET_SUCCESS:.1%}", met=ok >= TARGET_SUCCESS,
                        note=f"{res['get_ok']}/{keys} keys found; a dead node costs the 0.1 s request "
                             f"timeout (10 RTT); put replicas min {min(res['put_replicas'])}"))
    return rows


# ============================================================== 2. real daemons


def _daemon_env() -> dict:
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=str(REPO) + (os.pathsep + path if path else ""))


def start_daemons(base: Path, n: int, started: list[Daemon], dht: dict | None = None) -> list[Daemon]:
    """``n`` daemons on 127.0.0.1, the rest bootstrapped from the first (``dht``: keys of their
    ``[dht]`` section).  Each is appended to ``started`` before it starts, so that the caller
    can kill them whatever happens."""
    env = _daemon_env()
    config = {"nat": {"port_mapping": False, "stun_servers": []}}  # loopback only, whatever the defaults
    if dht:
        config["dht"] = dht
    first = Daemon(base / "d00", config=config, env=env)
    started.append(first)
    first.start(timeout=30)
    rest = [Daemon(base / f"d{i:02}", bootstrap=[str(first.address)], config=config, env=env)
            for i in range(1, n)]
    started.extend(rest)
    pool = ThreadPoolExecutor(4)  # start-up is mostly imports: overlap a few
    try:
        for fut in [pool.submit(d.start, 30) for d in rest]:
            fut.result()
    finally:  # on error, start no more; those starting finish, so the caller can kill them
        pool.shutdown(wait=True, cancel_futures=True)
    return [first, *rest]


async def _routing_sizes(dirs: list[Path]) -> list[int]:
    sizes = []
    for d in dirs:
        async with meshd.connect(d) as client:
            sizes.append((await client.dht_routing())["size"])
    return sizes


def wait_for_routing(daemons: list[Daemon], timeout: float, stable_s: float = 3.0) -> tuple[list[int], float]:
    """Poll every daemon's routing table until each knows all the others, or until every
    table is non-empty and none has changed for ``stable_s`` (daemons that joined at the
    same moment only meet at a later lookup); at most ``timeout`` seconds.  Returns the
    last sizes and the seconds waited; raises DaemonError if a table is still empty."""
    dirs = [d.data_dir for d in daemons]
    t0 = time.monotonic()
    last, since = None, t0
    while True:
        sizes = trio.run(_routing_sizes, dirs)
        now = time.monotonic()
        if sizes != last:
            last, since = sizes, now
        if min(sizes) >= len(daemons) - 1 or (min(sizes) > 0 and now - since >= stable_s):
            return sizes, now - t0
        if now - t0 > timeout:
            if min(sizes) == 0:
                raise DaemonError(f"routing tables still empty after {timeout:.0f} s: {sizes}")
            return sizes, now - t0
        time.sleep(0.25)


async def _timed(call, timeout: float):
    """(result, seconds, error text or None) of one control call, bounded by ``timeout``."""
    t0 = time.perf_counter()
    try:
        with trio.fail_after(timeout):
            result = await call
    except (meshd.RpcError, meshd.DaemonNotRunning, trio.TooSlowError, OSError) as exc:
        return None, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"
    return result, time.perf_counter() - t0, None


class _Ops:
    """The measurements on one set of running daemons, made through their control sockets."""

    def __init__(self, daemons: list[Daemon], rng: random.Random, op_timeout: float):
        self.clients = [meshd.Client(socket_path(d.data_dir)) for d in daemons]
        self.rng = rng
        self.op_timeout = op_timeout
        self.keys: dict[bytes, bytes] = {}  # key -> value, for every put that succeeded
        self.errors: list[str] = []

    async def put(self, writer: int, key: bytes):
        """(replicas or None, seconds, success)."""
        value = os.urandom(VALUE_SIZE)
        replicas, dt, err = await _timed(self.clients[writer].dht_put(key, value), self.op_timeout)
        if err:
            self.errors.append(f"put: {err}")
        else:
            self.keys[key] = value
        return replicas, dt, err is None and bool(replicas)

    async def get(self, reader: int, key: bytes):
        """(seconds, found the value, answered without error)."""
        record, dt, err = await _timed(self.clients[reader].dht_get(key), self.op_timeout)
        if err:
            self.errors.append(f"get: {err}")
        ok = err is None and record is not None and record["value"] == self.keys[key]
        return dt, ok, err is None

    async def warm_up(self, n_ops: int, tag: str) -> None:
        """Untimed puts and gets with every daemon as writer and as reader, so that the
        connections between them are open before anything is timed."""
        count = len(self.clients)
        for i in range(max(n_ops, count)):
            key = f"/open/bench-warm-{tag}-{i}".encode()
            await self.put(i % count, key)
            if key in self.keys:
                await self.get((i + 1 + i // count) % count, key)
        self.keys.clear()
        self.errors.clear()

    async def put_get(self, n_ops: int, tag: str) -> dict:
        """Put from a random daemon, then get the key from another one; ``n_ops`` times."""
        count = len(self.clients)
        put_lat, get_lat, put_ok, get_ok, replicas = [], [], 0, 0, []
        for i in range(n_ops):
            writer = self.rng.randrange(count)
            reader = self.rng.choice([j for j in range(count) if j != writer])
            key = f"/open/bench-{tag}-{i}".encode()
            n_rep, dt, ok = await self.put(writer, key)
            put_lat.append(dt)
            put_ok += ok
            if n_rep is not None:
                replicas.append(n_rep)
            if key not in self.keys:
                continue  # the put failed: nothing to get (counts as a failed get)
            dt, ok, answered = await self.get(reader, key)
            if answered:
                get_lat.append(dt)
            get_ok += ok
        return {"put_lat": put_lat, "get_lat": get_lat, "put_ok": put_ok, "get_ok": get_ok,
                "ops": n_ops, "replicas": replicas}

    async def get_all(self, readers: list[int], budget_s: float, at_once: bool) -> dict:
        """Get every key put so far from the daemons in ``readers``, each key once, within
        ``budget_s``: with ``at_once`` every reader works through its share of the keys at the
        same time (one get in flight per reader), otherwise one get at a time, readers in turn."""
        keys = list(self.keys)
        self.rng.shuffle(keys)
        lat, ok, tried = [], 0, 0
        t0 = time.perf_counter()

        async def read(index: int, share: list[bytes]) -> None:
            nonlocal ok, tried
            for key in share:
                if time.perf_counter() - t0 > budget_s:
                    return
                dt, good, answered = await self.get(index, key)
                if answered:
                    lat.append(dt)
                ok += good
                tried += 1

        if at_once:
            async with trio.open_nursery() as nursery:
                for j, index in enumerate(readers):
                    nursery.start_soon(read, index, keys[j::len(readers)])
        else:
            for j, key in enumerate(keys):
                await read(readers[j % len(readers)], [key])
        return {"get_lat": lat, "get_ok": ok, "tried": tried, "keys": len(keys), "readers": len(readers),
                "at_once": at_once, "wall_s": time.perf_counter() - t0}


def _real_one(n: int, args, rng: random.Random, dht: dict | None = None) -> dict:
    """Start ``n`` daemons (``dht``: their ``[dht]`` keys), measure, kill 30 %, measure again;
    every daemon is killed on exit."""
    started: list[Daemon] = []
    res: dict = {"daemons": n, "dht": dht or {}}
    with tempfile.TemporaryDirectory(prefix="meshd-dht-bench-") as tmp:
        try:
            t0 = time.perf_counter()
            daemons = start_daemons(Path(tmp), n, started, dht)
            res["start_s"] = time.perf_counter() - t0
            sizes, waited = wait_for_routing(daemons, args.settle_timeout)
            res["routing_sizes"], res["routing_wait_s"] = sizes, waited
            log(f"[real] {n} daemons up in {res['start_s']:.1f} s; routing tables {min(sizes)}-{max(sizes)} "
                f"contacts after {waited:.1f} s more")
            ops = _Ops(daemons, rng, args.op_timeout)
            trio.run(ops.warm_up, args.warmup, str(n))
            res["routing_sizes_warm"] = trio.run(_routing_sizes, [d.data_dir for d in daemons])
            res["live"] = trio.run(ops.put_get, args.ops, str(n))
            res["live_errors"] = ops.errors[:5]
            ops.errors = []
            log(f"[real] {n} daemons: {args.ops} puts and gets done")

            victims = rng.sample(range(n), round(n * DEAD_FRACTION))
            for i in victims:
                daemons[i].kill()  # SIGKILL: no goodbye to anyone
            survivors = [i for i in range(n) if i not in victims]
            res["killed"] = len(victims)
            res["dead"] = trio.run(ops.get_all, survivors, args.dead_budget, True)
            log(f"[real] {n} daemons, {len(victims)} killed: first pass, {res['dead']['tried']} gets "
                f"in {res['dead']['wall_s']:.1f} s")
            res["dead_again"] = trio.run(ops.get_all, survivors, args.dead_budget, False)
            log(f"[real] {n} daemons, {len(victims)} killed: second pass, {res['dead_again']['tried']} gets "
                f"in {res['dead_again']['wall_s']:.1f} s")
            res["dead_errors"] = ops.errors[:5]
        except BaseException:
            for d in started:
                if d.proc is not None and d.proc.poll() not in (None, -9):
                    log(f"--- {d.data_dir.name} exited {d.proc.returncode}: {d.tail_log(5)}")
            raise
        finally:
            for d in started:
                d.kill()
                if d.proc is not None and d.proc.stdout is not None:
                    d.proc.stdout.close()
    return res


def real_rows(counts: list[int], args, results: dict) -> list[dict]:
    rows = []
    for quorums in args.quorums:
        rows += _real_rows(counts, args, results, quorums)
    return rows


def _real_rows(counts: list[int], args, results: dict, quorums: tuple[int, int] | None) -> list[dict]:
    """The rows of daemons with the default quorums (``quorums`` None), or with (put_quorum,
    get_quorum): 1/1 is what Lattica waits for (libp2p's Quorum::One: a put returns at the
    first replica that stored, a get at the first record found)."""
    rows = []
    rng = random.Random(args.seed)
    sysname, dht = "meshd daemons", None
    if quorums is not None:
        sysname, dht = f"meshd, quorum {quorums[0]}/{quorums[1]}", dict(zip(("put_quorum", "get_quorum"), quorums))
    for n in counts:
        log(f"[real] starting {n} daemons{'' if dht is None else f' ({dht})'} ...")
        try:
            res = _real_one(n, args, rng, dht)
        except Exception as exc:
            results.setdefault("real", []).append({"daemons": n, "error": f"{type(exc).__name__}: {exc}"})
            rows.append(row(sysname, "put / get", n, note=f"failed: {type(exc).__name__}: {exc}"[:200]))
            continue
        results.setdefault("real", []).append(res)
        live, warm = res["live"], res["routing_sizes_warm"]
        at_target = n == TARGET_DAEMONS and quorums is None  # the targets are the defaults'
        p50 = _ms(live["put_lat"], 50)
        rows.append(row(sysname, "put latency", n, p50, _ms(live["put_lat"], 95), _ms(live["put_lat"], 99),
                        success=live["put_ok"] / live["ops"], unit="ms", kind="store",
                        target=f"p50 ≤ {TARGET_PUT_MS:g} ms" if at_target else "",
                        met=(p50 is not None and p50 <= TARGET_PUT_MS) if at_target else None,
                        note=f"{live['ops']} puts from random daemons via the control socket; replicas p50 "
                             f"{pct(live['replicas'], 50)}; routing tables {min(warm)}-{max(warm)} contacts"))
        p50 = _ms(live["get_lat"], 50)
        rows.append(row(sysname, "get latency", n, p50, _ms(live["get_lat"], 95), _ms(live["get_lat"], 99),
                        success=live["get_ok"] / live["ops"], unit="ms", kind="get",
                        target=f"p50 ≤ {TARGET_GET_MS:g} ms" if at_target else "",
                        met=(p50 is not None and p50 <= TARGET_GET_MS) if at_target else None,
                        note="from another daemon, right after the put"))
        survivors = n - res["killed"]
        for key, label, what in (
                ("dead", "get latency, 30% killed",
                 f"SIGKILL {res['killed']}, then every key at once from the {survivors} survivors, 1 get each "
                 f"in flight"),
                ("dead_again", "… 2nd pass", "every key again, 1 get at a time")):
            d = res[key]
            ok = d["get_ok"] / d["tried"] if d["tried"] else 0.0
            cut = "" if d["tried"] == d["keys"] else f" (budget: {d['tried']}/{d['keys']} keys tried)"
            p95 = _ms(d["get_lat"], 95)
            first = key == "dead"  # the first pass also has a latency target
            targeted = quorums is None
            rows.append(row(sysname, label, n, _ms(d["get_lat"], 50), p95,
                            _ms(d["get_lat"], 99), success=ok, unit="ms", kind=key,
                            target=(f"≥ {TARGET_SUCCESS:.1%}" + (f", p95 ≤ {TARGET_DEAD_P95_MS:g} ms" if first else ""))
                            if targeted else "",
                            met=(d["tried"] > 0 and ok >= TARGET_SUCCESS
                                 and (not first or (p95 is not None and p95 <= TARGET_DEAD_P95_MS)))
                            if targeted else None,
                            note=f"{what}; {d['wall_s']:.1f} s{cut}"))
    return rows


# ============================================================== 3. anchors


def anchor_targets(rows: list[dict]) -> None:
    """Issue 14's targets, from the anchors of this run: at every daemon count an anchor
    ran, our put p50 ≤ Lattica's store p50 and our get p50 ≤ the faster anchor's get p50
    (in place of the fixed targets, which stay where no anchor ran)."""
    def p50(system: str, kind: str, n: int) -> float | None:
        return next((r["p50"] for r in rows if r["system"] == system and r["kind"] == kind and r["n"] == n
                     and r["p50"] is not None), None)

    for r in rows:
        if r["system"] != "meshd daemons" or r["kind"] not in ("store", "get") or r["p50"] is None:
            continue
        if r["kind"] == "store":
            bound, whose = p50("Lattica (anchor)", "store", r["n"]), "Lattica's store"
        else:
            gets = {name: p50(f"{name} (anchor)", "get", r["n"]) for name in ("Lattica", "hivemind")}
            whose, bound = min(((n, v) for n, v in gets.items() if v is not None), key=lambda nv: nv[1],
                               default=(None, None))
            whose = f"{whose}'s get (the faster anchor)"
        if bound is not None:
            r["target"], r["met"] = f"p50 ≤ {whose}, {bound:.1f} ms", r["p50"] <= bound


_ANCHOR_SPECS = [  # name, args attribute with the venv's python, script, extra args
    ("Lattica", "lattica_python", "lattica_bench.py", ["--skip", "rpc"]),
    ("hivemind", "hivemind_python", "hivemind_bench.py", ["--skip", "p2p", "--no-averager"]),
]


def anchor_rows(counts: list[int], args, results: dict) -> list[dict]:
    rows = []
    for name, attr, script, extra in _ANCHOR_SPECS:
        sysname = f"{name} (anchor)"
        t0 = time.perf_counter()
        try:
            res = run_anchor(getattr(args, attr), Path(args.anchors_dir) / script,
                             [*extra, "--dht-sizes", ",".join(map(str, counts)), "--keys", str(args.ops)],
                             args.anchor_timeout)
        except Exception as exc:
            res = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"[anchors] {name} done in {time.perf_counter() - t0:.1f} s")
        results.setdefault("anchors", {})[name] = res
        errors = [res["error"]] if res.get("error") else list(res.get("errors", []))
        if not res.get("dht"):
            rows.append(row(sysname, "store / get", None, note="; ".join(errors)[:200] or "no DHT results"))
            continue
        where = ("latency inside the node's process" if name == "Lattica"
                 else "incl. the hop into its DHT process")
        for d in res["dht"]:
            rows.append(row(sysname, "store latency", d["nodes"], d["store_p50_ms"], None, d["store_p99_ms"],
                            success=d["store_success"], unit="ms", kind="store",
                            note=f"{name.lower()} {res.get('version', '?')}, own netns; {d['keys']} keys, "
                                 f"store on one node"))
            rows.append(row(sysname, "get latency", d["nodes"], d["get_p50_ms"], None, d["get_p99_ms"],
                            success=d["get_success"], unit="ms", kind="get", note=f"from another node; {where}"))
        if errors:
            rows.append(row(sysname, "errors", None, note="; ".join(errors)[:200]))
    return rows


# ============================================================== output


def _num(value, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ms":
        return f"{value:,.2f}"
    return f"{value:g}" if float(value).is_integer() else f"{value:.1f}"


_KINDS = ("store", "get", "dead", "dead_again")


def _section(r: dict) -> str:
    return f"n={r['n']}" if r["kind"] in _KINDS else f"{r['system']} {r['n']}"


def arrange(rows: list[dict]) -> list[dict]:
    """Simulation rows as they came; then per node count, ours and the anchors' store rows
    together, then the get rows, then ours with daemons killed; rows without numbers last."""
    systems = list(dict.fromkeys(r["system"] for r in rows))
    paired = sorted((r for r in rows if r["kind"] in _KINDS),
                    key=lambda r: (r["n"], _KINDS.index(r["kind"]), systems.index(r["system"])))
    return ([r for r in rows if r["kind"] not in _KINDS and r["n"] is not None] + paired
            + [r for r in rows if r["kind"] not in _KINDS and r["n"] is None])


def print_table(rows: list[dict], title: str) -> None:
    table = Table(title=title)
    for col in ("system", "measure", "N", "p50", "p95", "p99", "success", "target", "note"):
        table.add_column(col, justify="right" if col in ("N", "p50", "p95", "p99", "success") else "left")
    last = None
    for r in arrange(rows):
        if last is not None and _section(r) != last:
            table.add_section()
        last = _section(r)
        target = r["target"]
        if r["met"] is not None:
            target = f"{target} [green]met[/]" if r["met"] else f"{target} [red]MISSED[/]"
        table.add_row(r["system"], r["measure"] + (f" ({r['unit']})" if r["unit"] else ""),
                      "-" if r["n"] is None else f"{r['n']:,}",
                      _num(r["p50"], r["unit"]), _num(r["p95"], r["unit"]), _num(r["p99"], r["unit"]),
                      "-" if r["success"] is None else f"{r['success']:.1%}", target, r["note"])
    Console(width=230).print(table)


def _quorums(text: str) -> list[tuple[int, int] | None]:
    runs = []
    for item in text.split(","):
        if item.strip() == "default":
            runs.append(None)
            continue
        put, _, get = item.partition("/")
        if not (put.strip().isdigit() and get.strip().isdigit() and int(put) > 0 and int(get) > 0):
            raise argparse.ArgumentTypeError(f"{item!r}: expected 'default' or PUT/GET, e.g. 1/1")
        runs.append((int(put), int(get)))
    return runs


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip", default="", help="comma list of: sim, real, anchors")
    parser.add_argument("--sizes", type=_ints, default=[1000, 10_000], help="simulated network sizes")
    parser.add_argument("--daemons", type=_ints, default=[16, 20],
                        help="real daemon counts (the anchors run the same counts)")
    parser.add_argument("--quorums", type=_quorums, default=[None, (1, 1)],
                        help="daemon runs, each 'default' or PUT/GET quorums: a put returns once PUT replicas "
                             "stored, a get once GET records came (default: default,1/1; Lattica uses 1/1)")
    parser.add_argument("--ops", type=int, default=150,
                        help="timed puts (each followed by a get) per daemon count; also the anchors' --keys")
    parser.add_argument("--lookups", type=int, default=200, help="simulated lookups per size")
    parser.add_argument("--keys", type=int, default=300, help="simulated keys put, then got with 30%% dead")
    parser.add_argument("--warmup", type=int, default=20,
                        help="untimed put+get pairs before timing (at least one per daemon)")
    parser.add_argument("--settle-timeout", type=float, default=30.0,
                        help="at most this many seconds waiting for the routing tables to fill")
    parser.add_argument("--op-timeout", type=float, default=35.0,
                        help="seconds before one put/get counts as failed (a daemon lookup gives up at 30)")
    parser.add_argument("--dead-budget", type=float, default=60.0,
                        help="seconds for each pass of gets after the kill; keys not tried are left out")
    parser.add_argument("--anchors-dir", default=str(ANCHORS),
                        help="folder with lattica_bench.py and hivemind_bench.py (default ../shared/anchors)")
    parser.add_argument("--lattica-python", default="/tmp/lat-venv/bin/python")
    parser.add_argument("--hivemind-python", default="/tmp/hm-venv/bin/python")
    parser.add_argument("--anchor-timeout", type=float, default=240.0, help="seconds per anchor script")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", metavar="FILE", help="also write the rows and raw samples as JSON")
    args = parser.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - {"sim", "real", "anchors"}:
        parser.error(f"--skip: unknown part(s) {', '.join(sorted(skip - {'sim', 'real', 'anchors'}))}")

    stop_on_sigterm()
    t0 = time.perf_counter()
    results: dict = {"cpus": os.cpu_count(), "args": vars(args)}
    parts = [("sim", lambda: sim_rows(args.sizes, args.lookups, args.keys, results)),
             ("real", lambda: real_rows(args.daemons, args, results)),
             ("anchors", lambda: anchor_rows(args.daemons, args, results))]
    rows, rc = run_parts(parts, ",".join(skip),
                         lambda name, message: row(name, "failed", None, note=message),
                         row("interrupted", "(the rows above are all there is)", None))
    results["wall_s"] = time.perf_counter() - t0
    anchor_targets(rows)
    results["rows"] = rows
    print_table(rows, f"DHT: simulated ({LATENCY * 1e3:g} ms one way, virtual time), then real daemons and "
                      f"anchors on 127.0.0.1 ({os.cpu_count()} CPUs); run took {results['wall_s']:.0f} s")
    save_json(args.json, results)
    return rc


if __name__ == "__main__":
    sys.exit(main())
