"""Learning throughput: one DiLoCo outer sync of a large model among members in their own processes,
beside hivemind's DecentralizedAverager moving the same bytes in the same run.

    .venv/bin/python benchmarks/learning_throughput.py [--mib 256] [--members 4] [--syncs 3] [--warmup 2]
        [--codecs none,int8] [--skip ceiling,meshd,hivemind] [--json FILE] [--logs DIR]

One table, all on 127.0.0.1 (MB = 1e6 bytes, MiB = 2**20); about 3 min at 256 MiB on 2 cores, and
~2.5 GiB of memory per member:

1. Ceiling: a memcpy of ``--mib`` MiB in this process (one thread), ``--mib`` MiB over plain TCP
   between two processes, and ``--mib`` MiB down one meshd QUIC RPC stream between two nodes in two
   processes (the path tensors take to a peer without a direct path, where the bulk lane cannot go).
2. meshd: ``--members`` processes, each one meshd node (services dht + learning, no NAT probing)
   holding a model of ``--mib`` MiB of float32 parameters (tensors of ``--tensor-mib``) and a
   ``meshd.learning.DiLoCo`` on it with H = 1 (each ``step()`` is one outer sync: Δ, the group's
   all-reduce, the Nesterov step, the state hash and the state offered for ``learning.pull``),
   payloads over the TCP bulk lane.  ``--warmup`` syncs run first, unmeasured but for memory (as
   hivemind's ``--hm-warmup`` rounds: the first syncs map each member's buffers and grow its heap,
   and take ~2x the CPU of later ones).
   The inner optimizer is SGD with no gradients; before each sync every member moves its parameters
   by its own noise, outside the timing.  The members start together (a barrier through their
   pipes); per sync we take the slowest member's all-reduce time (``SyncReport.seconds``) and its
   whole ``step()``, the bytes each member sent and received in tensor payload
   (``Group.bytes_in/out``), and each member's peak RSS (``VmHWM``, reset before the sync through
   ``/proc/self/clear_refs``) against its RSS once the node was up and the model and its inner
   optimizer built (what the training script holds without meshd), and just before the sync.  One row per codec in ``--codecs``.  The parent checks there is memory for the
   members before it starts them and kills them if the machine runs short (``--mem-floor``).
   ``--wrap-member0`` runs member 0 under a profiler (memray, py-spy).
3. hivemind: ``benchmarks/hivemind_averager.py`` under ``/tmp/hm-venv`` (``../shared/anchors/setup``)
   in its own loopback-only network namespace: the same members, tensors and rounds with
   ``DecentralizedAverager`` (matchmaking first, then the all-reduce timed from the trigger) after
   ``--hm-warmup`` unmeasured rounds; bytes are the namespace's loopback counters, memory the PSS of
   the member's processes sampled at 10 Hz.  ``int8`` is hivemind's Uniform8BitQuantization.

Targets (issue 12): our MB/s per member >= 5x hivemind's; peak memory per member <= 2x the model
beyond the model.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:1] = [str(REPO)]  # the repo, not this folder (benchmarks/nat.py shadows nat)

MiB, MB = 1 << 20, 1e6
GROUP = "throughput"
TARGET_RATE, TARGET_MEMORY = 5.0, 2.0


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


# --- memory, in any process --------------------------------------------------------------------


def status_mib(field: str) -> float:
    """``VmRSS`` or ``VmHWM`` of this process, MiB."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


def reset_peak() -> None:
    """Start ``VmHWM`` again from the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# --- a member (this file re-run with --member I) ---------------------------------------------------


def build_model(mib: int, tensor_mib: int, seed: int):
    """A module of ``mib`` MiB of float32 parameters in tensors of ``tensor_mib`` MiB (the last smaller)."""
    import torch

    torch.manual_seed(seed)
    model, left, i = torch.nn.Module(), mib * MiB // 4, 0
    while left > 0:
        n = min(left, tensor_mib * MiB // 4)
        model.register_parameter(f"w{i:03}", torch.nn.Parameter(torch.empty(n).uniform_(-0.5, 0.5)))
        left, i = left - n, i + 1
    return model


async def perturb(model, noise, seed: int) -> None:
    """What H inner steps would do, for the benchmark: every parameter moves by its own small noise,
    drawn into ``noise`` (a vector the size of the largest parameter, the training's own memory: no
    heap the sync's peak would count).  The node runs between tensors (as between a training loop's
    steps), so it keeps answering hellos."""
    import torch
    import trio

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            step = noise[:p.numel()].view(p.shape)
            torch.randn(p.shape, generator=gen, out=step)
            p.add_(step, alpha=1e-3)
            await trio.sleep(0)


async def member(args) -> None:
    import torch
    import trio

    import meshd
    import meshd.learning as ml
    from meshd.services.learning import LearningSection

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(relativeCreated)8.0f m{args.member} %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)  # members share the machine's cores, as a trainer's helper would

    def say(**msg) -> None:
        print(json.dumps(msg), flush=True)

    async def hear() -> str:
        line = await trio.to_thread.run_sync(sys.stdin.readline)
        if not line:
            raise SystemExit("the benchmark went away")
        return line.strip()

    cfg = meshd.Config()
    cfg.learning = LearningSection(heartbeat_interval=2.0, discover_interval=1.0,
                                   round_timeout_min=args.round_timeout, round_timeout_max=4 * args.round_timeout)
    async with meshd.open_node(Path(args.data_dir) / f"m{args.member}", listen="127.0.0.1:0", config=cfg,
                               services=["dht", "learning"],
                               bootstrap=[args.bootstrap] if args.bootstrap else []) as node:
        if args.bootstrap:
            await node.connect(args.bootstrap)
        say(ready=str(node.address))
        rss_start = status_mib("VmRSS")
        model = build_model(args.mib, args.tensor_mib, seed=0)  # one shared init
        inner = torch.optim.SGD(model.parameters(), lr=0.1)  # (its first use maps ~70 MiB of torch.optim's code)
        noise = torch.zeros(max(p.numel() for p in model.parameters()))  # the stand-in inner steps' memory
        rss_model = status_mib("VmRSS")  # the baseline: node up, the training script's model and optimizer built
        opt = ml.DiLoCo(node, model, inner_opt=inner, group=GROUP, inner_steps=1, compression=args.codec)
        group = opt.group
        rss_diloco = status_mib("VmRSS")
        with trio.fail_after(120):
            while len(group.live()) < args.members:
                await trio.sleep(0.1)
        await opt._start()  # offer our state, take the lowest key's (same init): before any timing
        say(joined=len(group.live()), rss_start=rss_start, rss_model=rss_model, rss_diloco=rss_diloco,
            rss_joined=status_mib("VmRSS"))
        if await hear() != "start":  # every member has its state (the pulls are served and counted)
            return
        for k in range(args.syncs):
            await perturb(model, noise, seed=1000 * k + args.member)
            with trio.move_on_after(30):  # everyone live again in our view before the sync
                while len(group.live()) < args.members:
                    await trio.sleep(0.1)
            before_in, before_out = sum(group.bytes_in.values()), sum(group.bytes_out.values())
            rss_before = status_mib("VmRSS")
            say(at=k)
            if await hear() != "go":
                return
            reset_peak()
            t0, cpu0 = time.perf_counter(), time.process_time()
            await opt.step(samples=1)
            step_s = time.perf_counter() - t0
            report = opt.reports[-1]
            await trio.sleep(0.5)  # late reduced slices served to slower members count as this sync's
            hwm = status_mib("VmHWM")
            say(sync=k, step_s=step_s, cpu_s=time.process_time() - cpu0, allreduce_s=report.seconds, contributors=report.contributors,
                missing=report.missing_values, bytes_in=sum(group.bytes_in.values()) - before_in,
                bytes_out=sum(group.bytes_out.values()) - before_out, rss_before=rss_before, hwm=hwm,
                rss_after=status_mib("VmRSS"), hash=group.hash.hex() if group.hash else None)
        say(done=True)
        await hear()  # stay up (serving slices) until every member is done


# --- the QUIC stream ceiling (this file re-run with --quic-serve) ------------------------------------


async def quic_serve(data_dir: str) -> None:
    import trio

    import meshd

    async with meshd.open_node(data_dir, listen="127.0.0.1:0", services=[]) as node:
        chunk = os.urandom(MiB)

        async def source(nbytes, ctx):
            for _ in range(nbytes // MiB):
                yield chunk

        node.rpc.register("bench.source", source)
        print(node.address, flush=True)
        await trio.sleep_forever()


async def quic_fetch(addr: str, total: int) -> float:
    import meshd

    with tempfile.TemporaryDirectory() as tmp:
        async with meshd.open_node(tmp, listen="127.0.0.1:0", services=[]) as node:
            peer = await node.connect(addr)
            async for _ in node.rpc.stream(peer, "bench.source", 8 * MiB, timeout=60):
                pass  # warm up
            got, t0 = 0, time.perf_counter()
            async for item in node.rpc.stream(peer, "bench.source", total, timeout=300):
                got += len(item)
            wall = time.perf_counter() - t0
    assert got == total, f"got {got} of {total} bytes"
    return wall


# --- the parent ---------------------------------------------------------------------------------------


def row(system, measure, **kw) -> dict:
    return dict(system=system, measure=measure, **kw)




def ceiling_rows(mib: int) -> list[dict]:
    import torch

    total, rows = mib * MiB, []
    torch.set_num_threads(1)
    src, dst = torch.rand(total // 4), torch.empty(total // 4)
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        walls.append(time.perf_counter() - t0)
    del src, dst
    rows.append(row("ceiling", f"memcpy {mib} MiB, 1 thread", mb_s=total / min(walls) / MB, seconds=min(walls),
                    detail="torch copy_, best of 3"))

    from benchmarks.parts import tcp_copy_seconds

    wall = tcp_copy_seconds(total)
    rows.append(row("ceiling", f"plain TCP {mib} MiB, 2 processes", mb_s=total / wall / MB, seconds=wall,
                    detail="16 MiB sendall -> recv_into, one way"))

    import trio

    with tempfile.TemporaryDirectory(prefix="meshd-quic-") as tmp:
        server = subprocess.Popen([sys.executable, __file__, "--quic-serve", tmp], stdout=subprocess.PIPE, text=True)
        try:
            addr = server.stdout.readline().strip()
            if not addr:
                raise RuntimeError("the QUIC server did not start")
            wall = trio.run(quic_fetch, addr, total)
        finally:
            server.kill()
            server.wait(10)
    rows.append(row("ceiling", f"meshd QUIC RPC stream {mib} MiB, 2 processes", mb_s=total / wall / MB,
                    seconds=wall, detail="one server stream, 1 MiB items, one way (what benchmarks/rpc.py's "
                                         "bulk measures)"))
    return rows


class Child:
    """A member process: JSON lines out (read by a thread into a queue), commands in."""

    def __init__(self, cmd: list[str], name: str, logdir: Path):
        self.name = name
        self.err_path = logdir / f"{name}.log"
        self.err = open(self.err_path, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     text=True, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                log(f"[{self.name}] {line.rstrip()}")
        self.lines.put(None)

    def expect(self, key: str, timeout: float) -> dict:
        try:
            msg = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.name}: no {key!r} within {timeout:.0f} s; {self.tail()}") from None
        if msg is None or key not in msg:
            raise RuntimeError(f"{self.name}: expected {key!r}, got {msg!r}; {self.tail()}")
        return msg

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass

    def tail(self, n: int = 4) -> str:
        self.err.flush()
        lines = self.err_path.read_text(errors="replace").strip().splitlines()
        return "stderr: " + " | ".join(lines[-n:]) if lines else "no stderr"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.err.close()


def mem_available_mib() -> float:
    with open("/proc/meminfo") as f:
        return int(re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


class MemoryGuard(threading.Thread):
    """Kills ``children`` if the machine's available memory falls under ``floor_mib`` (a shared machine)."""

    def __init__(self, children: list, floor_mib: float):
        super().__init__(daemon=True)
        self.children, self.floor, self.tripped = children, floor_mib, None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.25):
            if (left := mem_available_mib()) < self.floor:
                self.tripped = f"stopped: the machine had {left:,.0f} MiB available (floor {self.floor:,.0f})"
                log(f"[meshd] {self.tripped}")
                for c in list(self.children):
                    if c.proc.poll() is None:
                        c.proc.kill()
                return


def meshd_run(args, codec: str, tmp: Path) -> dict:
    """One group of ``args.members`` member processes doing ``args.syncs`` outer syncs with ``codec``."""
    base = [sys.executable, __file__, "--mib", str(args.mib), "--tensor-mib", str(args.tensor_mib),
            "--members", str(args.members), "--syncs", str(args.warmup + args.syncs), "--codec", codec,
            "--round-timeout", str(args.round_timeout), "--data-dir", str(tmp / codec)]
    if args.niceness:
        base = ["nice", "-n", str(args.niceness), *base]
    children: list[Child] = []
    res: dict = {"codec": codec, "syncs": [], "warmup": []}
    need = args.members * (args.mem_per_mib * args.mib + 500)
    if (have := mem_available_mib()) < need + args.mem_floor:
        raise RuntimeError(f"{args.members} members of {args.mib} MiB may need ~{need / 1024:,.1f} GiB at their peak, "
                           f"{have / 1024:,.1f} GiB is available (see --mem-per-mib, --mem-floor)")
    guard = MemoryGuard(children, args.mem_floor)
    guard.start()
    try:
        logdir = Path(args.logs) if args.logs else tmp
        logdir.mkdir(parents=True, exist_ok=True)
        wrap = shlex.split(args.wrap_member0.replace("{codec}", codec)) if args.wrap_member0 else []
        cmd0 = [*base, "--member", "0"]
        if wrap:  # the prefix takes the python executable's place
            i = cmd0.index(sys.executable)
            cmd0[i:i + 1] = wrap
        first = Child(cmd0, f"{codec}-m0", logdir)
        children.append(first)
        addr = first.expect("ready", 120)["ready"]
        for i in range(1, args.members):
            children.append(Child([*base, "--member", str(i), "--bootstrap", addr], f"{codec}-m{i}", logdir))
        for c in children[1:]:
            c.expect("ready", 120)
        res["joined"] = [c.expect("joined", 300) for c in children]
        for c in children:
            c.send("start")
        log(f"[meshd {codec}] {args.members} members joined; RSS after the model "
            f"{[round(j['rss_model']) for j in res['joined']]} MiB")
        for k in range(args.warmup + args.syncs):
            for c in children:
                c.expect("at", 300)
            t0 = time.perf_counter()
            for c in children:
                c.send("go")
            reports = [c.expect("sync", 4 * args.round_timeout + 60) for c in children]
            wall = time.perf_counter() - t0
            res["syncs" if k >= args.warmup else "warmup"].append({"wall_s": wall, "members": reports})
            log(f"[meshd {codec}] {'warm-up ' if k < args.warmup else ''}sync {k}: all-reduce {max(r['allreduce_s'] for r in reports):.2f} s, step "
                f"{max(r['step_s'] for r in reports):.2f} s, peak RSS {[round(r['hwm']) for r in reports]} MiB, "
                f"contributors {[r['contributors'] for r in reports]}")
        for c in children:
            c.expect("done", 60)
    except RuntimeError:
        if guard.tripped:
            raise RuntimeError(guard.tripped) from None
        raise
    finally:
        guard.stop.set()
        for c in children:
            c.send("exit")
        deadline = time.monotonic() + 15
        for c in children:  # they close their nodes (and a profiler writes its file), then are killed
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            c.kill()
    return res


def summarize_meshd(res: dict, model_mib: float, members: int) -> dict:
    syncs = res["syncs"]
    allreduce = [max(r["allreduce_s"] for r in s["members"]) for s in syncs]
    step = [max(r["step_s"] for r in s["members"]) for s in syncs]
    moved = [statistics.mean(r["bytes_in"] + r["bytes_out"] for r in s["members"]) for s in syncs]
    rates = [b / a / MB for b, a in zip(moved, allreduce)]
    joined = {i: j for i, j in enumerate(res["joined"])}
    every = syncs + res["warmup"]  # memory: the warm-up syncs' peaks count too
    beyond = max(r["hwm"] - joined[i]["rss_model"] for s in every for i, r in enumerate(s["members"]))
    transient = max(r["hwm"] - r["rss_before"] for s in every for r in s["members"])
    standing = max(r["rss_before"] - joined[i]["rss_model"] for s in syncs for i, r in enumerate(s["members"]))
    hashes = [{r["hash"] for r in s["members"]} for s in syncs]
    cpu = statistics.median(r["cpu_s"] for s in syncs for r in s["members"])
    return dict(cpu_s=cpu, allreduce_s=allreduce, step_s=step, bytes=statistics.median(moved), mb_s=statistics.median(rates),
                rates=rates, beyond_mib=beyond, beyond_x=beyond / model_mib, transient_mib=transient,
                transient_x=transient / model_mib, standing_mib=standing,
                agree=all(len(h) == 1 for h in hashes),
                contributors=min(r["contributors"] for s in syncs for r in s["members"]),
                missing=max(r["missing"] for s in syncs for r in s["members"]))


def meshd_rows(args, tmp: Path, results: dict) -> list[dict]:
    rows, model_mib = [], float(args.mib)
    for codec in args.codecs.split(","):
        res = results.setdefault("meshd", {})[codec] = meshd_run(args, codec, tmp)
        s = res["summary"] = summarize_meshd(res, model_mib, args.members)
        nominal = 2 * 2 * (args.members - 1) / args.members * args.mib * MiB
        rows.append(row(
            "meshd", f"DiLoCo outer sync (H=1), {codec}", mb_s=s["mb_s"],
            complete=s["agree"] and s["contributors"] == args.members and not s["missing"], seconds=statistics.median(s["allreduce_s"]),
            step_s=statistics.median(s["step_s"]), mb_member=s["bytes"] / MB, beyond=s["beyond_mib"],
            beyond_x=s["beyond_x"], transient=s["transient_mib"],
            detail=f"syncs: all-reduce {', '.join(f'{x:.2f}' for x in s['allreduce_s'])} s "
                   f"({', '.join(f'{x:,.0f}' for x in s['rates'])} MB/s); {s['contributors']} contributors, "
                   f"{s['missing']} values missing; hashes {'agree' if s['agree'] else 'DIFFER'}; "
                   f"{s['cpu_s']:.2f} CPU s per member (median; the step and 0.5 s after); "
                   f"{s['bytes'] / nominal:.2f}x the fp32 butterfly's {nominal / MB:,.0f} MB; standing state "
                   f"before the sync {s['standing_mib']:,.0f} MiB over the model"))
    return rows


def hivemind_rows(args, results: dict) -> list[dict]:
    from benchmarks.parts import run_anchor

    rows = []
    for codec in args.codecs.split(","):
        extra = ["--mib", str(args.mib), "--tensor-mib", str(args.tensor_mib), "--members", str(args.members),
                 "--rounds", str(args.hm_warmup + args.syncs), "--codec", codec]
        if args.niceness:
            extra += ["--nice", str(args.niceness)]
        hm = results.setdefault("hivemind", {})[codec] = run_anchor(
            args.hm_python, Path(__file__).resolve().parent / "hivemind_averager.py", extra, args.anchor_timeout)
        if hm.get("error") or not hm.get("rounds"):
            rows.append(row("hivemind", f"DecentralizedAverager, {codec}",
                            detail=str(hm.get("error") or hm.get("errors") or "no rounds")[:200]))
            continue
        warm, measured = hm["rounds"][:args.hm_warmup], hm["rounds"][args.hm_warmup:]
        good = [r for r in measured if r["ok"]]
        if not good:
            rows.append(row("hivemind", f"DecentralizedAverager, {codec}",
                            detail=f"every measured round failed: {(measured or warm)[-1].get('error', '')}"[:200]))
            continue
        secs, warm_secs = [r["allreduce_s"] for r in good], [r["allreduce_s"] for r in warm]
        payload = args.mib * MiB * (1 if codec == "none" else 0.25)  # fp32, or one byte a value
        moved = statistics.median(r["bytes_per_member"] for r in good) / (4 * (args.members - 1) / args.members
                                                                          * payload)
        rates = [r["bytes_per_member"] / r["allreduce_s"] / MB for r in good]
        beyond = max(r["beyond_mib"] for r in good)
        rows.append(row(
            "hivemind", f"DecentralizedAverager, {hm['compression']}", mb_s=statistics.median(rates),
            seconds=statistics.median(secs), step_s=statistics.median(r["step_s"] for r in good),
            mb_member=statistics.median(r["bytes_per_member"] for r in good) / MB, beyond=beyond,
            beyond_x=beyond / args.mib, transient=max(r["transient_mib"] for r in good),
            detail=f"hivemind {hm.get('version', '?')}, own netns; {moved:.2f}x the butterfly's bytes "
                   f"{'(values agree on every member)' if all(r.get('agree') for r in good) else '(values differ)'}"
                   f"{'; 8-bit decoder patched for numpy 2' if codec == 'int8' else ''}; measured rounds: all-reduce "
                   f"{', '.join(f'{x:.2f}' for x in secs)} s ({len(good)}/{len(measured)} ok, group of "
                   f"{min(r['group_size'] for r in good)}; after {len(warm)} warm-up round(s): "
                   f"{', '.join(f'{x:.2f} s' for x in warm_secs)}); step = matchmaking + all-reduce; "
                   f"bytes = loopback counters x2 / members; memory = PSS of the member's processes (incl. p2pd)"))
    return rows


def fmt(value, digits=0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_table(rows: list[dict], title: str, args) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("system", "measure", "sync s", "step s", "MB/s per member", "MB per member",
                "peak MiB over model", "× model", "sync's own MiB", "detail"):
        table.add_column(col, justify="left" if col in ("system", "measure", "detail") else "right")
    for i, r in enumerate(rows):
        if i and r["system"] != rows[i - 1]["system"]:
            table.add_section()
        table.add_row(r["system"], r["measure"], fmt(r.get("seconds"), 2), fmt(r.get("step_s"), 2),
                      fmt(r.get("mb_s")), fmt(r.get("mb_member")), fmt(r.get("beyond")), fmt(r.get("beyond_x"), 2),
                      fmt(r.get("transient")), r.get("detail", ""))
    Console(width=240).print(table)
    ours = {r["codec_key"]: r for r in rows if r["system"] == "meshd" and r.get("mb_s")}
    theirs = {r.get("codec_key"): r for r in rows if r["system"] == "hivemind" and r.get("mb_s")}
    for codec, r in ours.items():
        h = theirs.get(codec)
        ratio = f"{r['mb_s'] / h['mb_s']:.2f}x hivemind's rate" if h else "no hivemind row to compare"
        verdict = "" if not h else ("met" if r["mb_s"] >= TARGET_RATE * h["mb_s"] else "MISSED")
        mem = "met" if r["beyond_x"] <= TARGET_MEMORY else "MISSED"
        broken = "" if r.get("complete") else " [the sync was INCOMPLETE: see its detail]"
        print(f"{codec}: {ratio} (target >= {TARGET_RATE:g}x: {verdict or '-'}); peak memory "
              f"{r['beyond_x']:.2f}x the model beyond the model (target <= {TARGET_MEMORY:g}x: {mem}){broken}")
    print("MB = 1e6 bytes.  sync s: the slowest member's all-reduce (meshd: SyncReport.seconds; hivemind: trigger to\n"
          "result, after matchmaking).  step s: meshd's whole DiLoCo.step (all-reduce, outer Nesterov step, hash, state\n"
          "offer); hivemind's step() from the call (matchmaking included).  MB/s per member: bytes the member sent +\n"
          "received / sync s.  peak MiB over model: peak RSS (meshd VmHWM; hivemind PSS summed over the member's\n"
          "processes, sampled) minus RSS once the model (meshd: and its inner optimizer) was built (x model: that over\n"
          "the model's size); sync's own MiB: peak minus RSS just before the sync.  The machine may be shared: compare\n"
          "rows of one run only.")


def tree() -> dict:
    """Which code ran: HEAD, the files that differ from it, and digests of the learning service's files."""
    import hashlib

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    files = ("meshd/services/learning/group.py", "meshd/services/learning/diloco.py", "learn/allreduce.py")
    return {"head": git("rev-parse", "--short", "HEAD"), "changed": git("status", "--short").splitlines(),
            "sha256": {f: hashlib.sha256((REPO / f).read_bytes()).hexdigest()[:12] for f in files
                       if (REPO / f).exists()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="model size in MiB of float32 parameters")
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--syncs", type=int, default=3, help="outer syncs (and measured hivemind rounds) per codec")
    parser.add_argument("--warmup", type=int, default=2,
                        help="meshd syncs before the measured ones (the first two map buffers and grow the heap)")
    parser.add_argument("--hm-warmup", type=int, default=2,
                        help="hivemind rounds before the measured ones (its first round opens its connections)")
    parser.add_argument("--codecs", default="none,int8", help="comma list: none, int8 (hivemind: Uniform8Bit)")
    parser.add_argument("--tensor-mib", type=int, default=16, help="size of each parameter tensor")
    parser.add_argument("--round-timeout", type=float, default=120.0,
                        help="learning.round_timeout_min: how long a reducer waits for slow members")
    parser.add_argument("--mem-per-mib", type=float, default=12.0,
                        help="the peak RSS a member is assumed to need per MiB of model, to check before starting")
    parser.add_argument("--mem-floor", type=float, default=1536.0,
                        help="MiB of available memory below which the members are killed (shared machines)")
    parser.add_argument("--skip", default="", help="comma list of: ceiling, meshd, hivemind")
    parser.add_argument("--niceness", type=int, default=0, help="run the members under nice -n N")
    parser.add_argument("--hm-python", default="/tmp/hm-venv/bin/python")
    parser.add_argument("--anchor-timeout", type=float, default=600.0, help="seconds per hivemind run")
    parser.add_argument("--wrap-member0", metavar="PREFIX",
                        help="run member 0 with PREFIX in place of the python executable, e.g. "
                             "'.venv/bin/python -m memray run -fo /tmp/m0-{codec}.bin' or "
                             "'.venv/bin/py-spy record -f raw -o /tmp/m0-{codec}.txt -- .venv/bin/python'")
    parser.add_argument("--logs", metavar="DIR", help="keep each member's log (stderr) in DIR")
    parser.add_argument("--json", metavar="FILE", help="also write the rows and every member's report as JSON")
    # a member process, or the QUIC ceiling's server
    parser.add_argument("--member", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--codec", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    parser.add_argument("--quic-serve", metavar="DATA_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()

    import trio

    if args.quic_serve:
        trio.run(quic_serve, args.quic_serve)
        return 0
    if args.member is not None:
        trio.run(member, args)
        return 0

    from benchmarks.parts import run_parts, save_json, stop_on_sigterm

    if unknown := {s for s in args.skip.split(",") if s} - {"ceiling", "meshd", "hivemind"}:
        parser.error(f"--skip: unknown part(s) {', '.join(sorted(unknown))}")
    if unknown := set(args.codecs.split(",")) - {"none", "int8"}:
        parser.error(f"--codecs: unknown codec(s) {', '.join(sorted(unknown))}")
    os.chdir(REPO)
    stop_on_sigterm()
    t0 = time.perf_counter()
    results: dict = {"cpus": os.cpu_count(), "args": vars(args), "load_before": os.getloadavg(), "tree": tree()}
    with tempfile.TemporaryDirectory(prefix="meshd-learn-tp-") as tmp:
        parts = [("ceiling", lambda: ceiling_rows(args.mib)),
                 ("meshd", lambda: meshd_rows(args, Path(tmp), results)),
                 ("hivemind", lambda: hivemind_rows(args, results))]
        rows, rc = run_parts(parts, args.skip, lambda name, message: row(name, "FAILED", detail=message),
                             row("interrupted", "(the rows above are all there is)"))
    for r in rows:  # the codec a row is about, to pair ours with hivemind's
        r["codec_key"] = "int8" if "int8" in r["measure"].lower() or "8bit" in r["measure"].lower() else "none"
    results["rows"], results["wall_s"] = rows, time.perf_counter() - t0
    results["load_after"] = os.getloadavg()
    print_table(rows, f"One outer sync of a {args.mib:,} MiB fp32 model among {args.members} members, each its own "
                      f"process, 127.0.0.1 ({os.cpu_count()} CPUs, load {results['load_before'][0]:.1f} before; run "
                      f"took {results['wall_s']:.0f} s)", args)
    t = results["tree"]
    print(f"code: HEAD {t['head']}{' + uncommitted changes' if t['changed'] else ''}; "
          + ", ".join(f"{Path(f).name} {h}" for f, h in t["sha256"].items()))
    save_json(args.json, results)
    return rc or int(any(r["measure"] == "FAILED" for r in rows))


if __name__ == "__main__":
    sys.exit(main())
