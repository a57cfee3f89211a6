#!/usr/bin/env python3
"""Anchor for benchmarks/learning_throughput.py: hivemind's DecentralizedAverager, N members, one big model.

Run with hivemind's venv (``../shared/anchors/setup`` makes ``/tmp/hm-venv``)::

    /tmp/hm-venv/bin/python benchmarks/hivemind_averager.py [--mib 256] [--members 4] [--rounds 2]
        [--codec none|int8] [--json out.json]

``../shared/anchors/hivemind_bench.py`` averages one tensor between 2 peers in one process; this
script does what our benchmark does: ``--members`` processes, each its own ``hivemind.DHT`` (its own
p2pd) and a ``DecentralizedAverager`` over ``--mib`` MiB of float32 tensors of ``--tensor-mib``,
``target_group_size = min_group_size = --members``.  Each round every member moves its tensors by
its own noise, calls ``step(require_trigger=True, wait=False)`` and waits for matchmaking
(``AWAITING_TRIGGER``); once every member is matched they are triggered together and the all-reduce
is timed from the trigger to the result (``step_s`` is from the call, matchmaking included).
``--codec int8`` is hivemind's ``Uniform8BitQuantization`` (hivemind's blockwise 8-bit needs
bitsandbytes), with its decoder patched for numpy 2 (see :func:`patch_quantization`; unpatched, every
peer's part is dropped and the round silently averages nothing).

Bytes: the loopback counters of the private network namespace (``unshare -n``, as the anchors do;
p2pd talks to Python over Unix sockets, so ``lo`` carries only peer traffic): per member sent +
received = 2 x bytes sent on lo / members.  Memory: PSS summed over each member's processes (the
member, its DHT and averager processes, p2pd), sampled at 10 Hz by the parent, against the sum once
the DHT was up and the model built, and just before the trigger.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ANCHORS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "anchors")
MiB = 1 << 20
P2P_KW = dict(nat_port_map=False, auto_nat=False)  # keep p2pd from probing gateways / the internet
PREFIX = "throughput"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# --- a member process -----------------------------------------------------------------------------


def patch_quantization():
    """hivemind 1.1.12's 8-bit codecs cannot decode under numpy 2 (``int()`` of a 1-element array raises
    TypeError), so every part a peer sends is dropped and a round "succeeds" with only the member's own
    values ("Reducer: received 25.0% of input tensors").  The same method with the element taken out."""
    import numpy as np
    import torch
    from hivemind.compression.quantization import Quantization

    def extract(self, serialized_tensor):
        codebook_size = int(np.frombuffer(serialized_tensor.buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(serialized_tensor.buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(serialized_tensor.buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
        codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)

    Quantization.extract = extract



def member(args):
    import torch
    import hivemind
    from hivemind.averaging.control import AveragingStage
    from hivemind.compression import NoCompression, Uniform8BitQuantization

    torch.set_num_threads(1)
    if args.codec == "int8":
        patch_quantization()

    def say(**msg):
        print(json.dumps(msg), flush=True)

    def hear():
        line = sys.stdin.readline()
        if not line:
            raise SystemExit("the benchmark went away")
        return line.strip()

    peers = json.loads(args.bootstrap) if args.bootstrap else []
    dht = hivemind.DHT(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, **P2P_KW)
    torch.manual_seed(0)  # one shared init, the same layout as ours
    tensors, left = [], args.mib * MiB // 4
    while left > 0:
        n = min(left, args.tensor_mib * MiB // 4)
        tensors.append(torch.empty(n).uniform_(-0.5, 0.5))
        left -= n
    say(model=True, maddrs=[str(m) for m in dht.get_visible_maddrs()])
    hear()  # the parent has taken the baseline
    compression = Uniform8BitQuantization() if args.codec == "int8" else NoCompression()
    avg = hivemind.averaging.DecentralizedAverager(
        averaged_tensors=tensors, dht=dht, prefix=PREFIX, target_group_size=args.members,
        min_group_size=args.members, min_matchmaking_time=args.matchmaking, request_timeout=args.matchmaking / 2,
        compression=compression, start=True)
    del tensors
    say(ready=True, compression=type(compression).__name__)
    for k in range(args.rounds):
        if hear() != "round":
            break
        gen = torch.Generator().manual_seed(1000 * k + args.member)
        with avg.get_tensors() as ts:
            for t in ts:
                t.add_(torch.randn(t.shape, generator=gen), alpha=1e-3)
        t_step = time.perf_counter()
        control = avg.step(require_trigger=True, wait=False, timeout=args.step_timeout)
        while control.stage not in (AveragingStage.AWAITING_TRIGGER, AveragingStage.FINISHED) and not control.done():
            time.sleep(0.005)
        say(matched=control.stage.name, matchmaking_s=time.perf_counter() - t_step)
        if hear() != "go":
            break
        t0 = time.perf_counter()
        error = None
        try:
            control.allow_allreduce()
            out = control.result(timeout=args.step_timeout)
        except Exception as e:  # a failed round is reported, not fatal
            out, error = None, f"{type(e).__name__}: {e}"[:200]
        t1 = time.perf_counter()
        import hashlib

        digest = hashlib.sha256()
        with avg.get_tensors() as ts:
            for t in ts:
                digest.update(t.numpy().tobytes())
        say(digest=digest.hexdigest()[:16], round=k, ok=out is not None, allreduce_s=t1 - t0, step_s=t1 - t_step, group_size=len(out or {}),
            error=error)
    hear()  # stay up until every member is done
    avg.shutdown()
    dht.shutdown()


# --- the parent (in the network namespace) -----------------------------------------------------------


def lo_tx_bytes():
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    raise RuntimeError("no lo in /proc/net/dev")


def tree(root):
    """``root`` and every process below it."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def pss_mib(pids):
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            pass
    return total / 1024


class Sampler(threading.Thread):
    """The peak PSS of each member's process tree since :meth:`reset`, every ``period`` seconds."""

    def __init__(self, roots, period=0.1):
        super().__init__(daemon=True)
        self.roots, self.period = roots, period
        self.trees = [tree(r) for r in roots]
        self.peak = [0.0] * len(roots)
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def refresh(self):
        self.trees = [tree(r) for r in self.roots]

    def now(self):
        return [pss_mib(t) for t in self.trees]

    def reset(self):
        with self.lock:
            self.peak = self.now()

    def run(self):
        while not self.stop.wait(self.period):
            values = self.now()
            with self.lock:
                self.peak = [max(p, v) for p, v in zip(self.peak, values)]


class Child:
    """A member process: its JSON lines (read by a thread into a queue), commands to its stdin."""

    def __init__(self, cmd):
        import queue

        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                log(f"[member {self.proc.pid}] {line.rstrip()}")
                continue
            self.lines.put(msg)
        self.lines.put(None)

    def expect(self, key, timeout):
        import queue

        try:
            msg = self.lines.get(timeout=timeout)
        except queue.Empty:
            msg = f"nothing in {timeout:g} s"
        if not isinstance(msg, dict) or key not in msg:
            raise RuntimeError(f"member {self.proc.pid}: expected {key!r}, got {str(msg)[:200]!r} "
                               f"(rc={self.proc.poll()})")
        return msg

    def send(self, line):
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass


def run(args):
    import importlib.metadata as md

    base = [sys.executable, os.path.abspath(__file__), "--mib", str(args.mib), "--tensor-mib", str(args.tensor_mib),
            "--members", str(args.members), "--rounds", str(args.rounds), "--codec", args.codec,
            "--matchmaking", str(args.matchmaking), "--step-timeout", str(args.step_timeout)]
    if args.nice:
        base = ["nice", "-n", str(args.nice), *base]
    res = {"version": md.version("hivemind"), "torch": md.version("torch"), "cpus": os.cpu_count(),
           "netns": os.environ.get("ANCHOR_BENCH_IN_NETNS") == "1", "members": args.members, "mib": args.mib,
           "rounds": [], "errors": []}
    children, sampler = [], None
    try:
        first = Child([*base, "--member", "0"])
        children.append(first)
        boot = first.expect("model", 120)["maddrs"]
        for i in range(1, args.members):
            children.append(Child([*base, "--member", str(i), "--bootstrap", json.dumps(boot)]))
        for c in children[1:]:
            c.expect("model", 120)
        sampler = Sampler([c.proc.pid for c in children])
        model_pss = sampler.now()  # DHT up, model built
        res["model_pss_mib"] = model_pss
        for c in children:
            c.send("baseline")
        res["compression"] = [c.expect("ready", 120) for c in children][0]["compression"]
        sampler.refresh()
        sampler.start()
        for k in range(args.rounds):
            for c in children:
                c.send("round")
            matched = [c.expect("matched", args.step_timeout + 30) for c in children]
            sampler.refresh()
            before = sampler.now()
            sampler.reset()
            tx0 = lo_tx_bytes()
            for c in children:
                c.send("go")
            reports = [c.expect("round", args.step_timeout + 30) for c in children]
            tx = lo_tx_bytes() - tx0
            peak = list(sampler.peak)
            r = dict(ok=all(x["ok"] for x in reports), allreduce_s=max(x["allreduce_s"] for x in reports),
                     step_s=max(x["step_s"] for x in reports),
                     matchmaking_s=max(x["matchmaking_s"] for x in matched), stages=[x["matched"] for x in matched],
                     group_size=min(x["group_size"] for x in reports), lo_bytes=tx,
                     agree=len({x["digest"] for x in reports}) == 1,
                     bytes_per_member=2 * tx / args.members,
                     beyond_mib=max(p - m for p, m in zip(peak, model_pss)),
                     transient_mib=max(p - b for p, b in zip(peak, before)), peak_pss_mib=peak,
                     error=next((x["error"] for x in reports if x["error"]), None))
            res["rounds"].append(r)
            log(f"[hivemind] round {k}: {json.dumps(r)}")
    except Exception as e:
        res["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        if sampler is not None:
            sampler.stop.set()
        for c in children:
            c.send("exit")
        deadline = time.time() + 15
        for c in children:
            try:
                c.proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        for c in children:  # the member, its DHT and averager processes and p2pd
            for pid in reversed(tree(c.proc.pid)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            c.proc.wait()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--tensor-mib", type=int, default=16)
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--codec", choices=("none", "int8"), default="none")
    ap.add_argument("--matchmaking", type=float, default=3.0, help="min_matchmaking_time (request_timeout is half)")
    ap.add_argument("--step-timeout", type=float, default=300.0)
    ap.add_argument("--nice", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--deadline", type=float, default=600.0)
    ap.add_argument("--no-netns", action="store_true")
    ap.add_argument("--member", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.member is not None:
        member(args)
        return 0

    def on_alarm(signum, frame):
        raise TimeoutError(f"exceeded --deadline {args.deadline:g} s")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(args.deadline))
    t0 = time.perf_counter()
    res = run(args)
    signal.alarm(0)
    res["wall_s"] = time.perf_counter() - t0
    for r in res["rounds"]:
        print(f"round: all-reduce {r['allreduce_s']:.2f} s, step {r['step_s']:.2f} s, "
              f"{r['bytes_per_member'] / r['allreduce_s'] / 1e6:,.0f} MB/s per member, peak PSS over the model "
              f"{r['beyond_mib']:,.0f} MiB, ok={r['ok']} group={r['group_size']}")
    for e in res["errors"]:
        print(f"ERROR: {e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    if "--member" not in sys.argv:
        sys.path.insert(0, ANCHORS)
        from _netns import reexec_in_loopback_netns

        reexec_in_loopback_netns(sys.argv)
    sys.exit(main())
