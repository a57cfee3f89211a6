#!/usr/bin/env python3
"""Anchor for benchmarks/experts.py: hivemind's RemoteExpert serving the same MLP under concurrent callers.

Run with hivemind's venv (``../shared/anchors/setup`` makes ``/tmp/hm-venv``)::

    /tmp/hm-venv/bin/python benchmarks/hivemind_expert.py [--width 2048] [--callers 64] [--seconds 6]
        [--max-batch 64] [--json out.json]

A hivemind ``Server`` (its own process, its own ``hivemind.DHT`` and p2pd) serves one expert of a
custom class registered with ``register_expert_class``: ``Linear(width, 4 width) -> ReLU ->
Linear(4 width, width)``, the module our serving row uses, with the server's batching
(``max_batch_size``; hivemind's runtime forms batches from what its task pool holds).  The caller
process joins the DHT, gets a ``RemoteExpert`` (``create_remote_experts``), warms it up, then
``--callers`` threads each call it with one row, again and again, for ``--seconds`` (hivemind's
client is blocking): rows/s and p50/p99 latency.  In a loopback-only network namespace, as the
anchors run.
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
P2P_KW = dict(nat_port_map=False, auto_nat=False)  # keep p2pd from probing gateways / the internet


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def register(width: int) -> None:
    import torch
    from hivemind.moe.server.layers.custom_experts import register_expert_class

    @register_expert_class("bench_mlp", lambda batch, dim: torch.randn(batch, dim))
    class BenchMLP(torch.nn.Module):
        def __init__(self, hid_dim):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(hid_dim, 4 * hid_dim), torch.nn.ReLU(),
                                           torch.nn.Linear(4 * hid_dim, hid_dim))

        def forward(self, x):
            return self.net(x)


def server(args) -> None:
    import torch
    from hivemind.moe.server import Server

    torch.set_num_threads(1)
    register(args.width)
    srv = Server.create(expert_uids=["bench_mlp.0"], expert_cls="bench_mlp", hidden_dim=args.width,
                        max_batch_size=args.max_batch, start=True, num_handlers=4,
                        host_maddrs=["/ip4/127.0.0.1/tcp/0"], **P2P_KW)  # the rest goes to its DHT
    print(json.dumps({"maddrs": [str(a) for a in srv.dht.get_visible_maddrs()]}), flush=True)
    try:
        sys.stdin.read()  # until the parent closes our stdin
    finally:
        srv.shutdown()


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def caller(args, maddrs) -> dict:
    import torch
    import hivemind
    from hivemind.moe.client.expert import create_remote_experts
    from hivemind.moe.server.dht_handler import get_experts

    torch.set_num_threads(1)
    dht = hivemind.DHT(start=True, initial_peers=maddrs, client_mode=True, **P2P_KW)
    infos = None
    for _ in range(100):
        infos = get_experts(dht, ["bench_mlp.0"])
        if infos and infos[0] is not None:
            break
        time.sleep(0.2)
    if not infos or infos[0] is None:
        raise RuntimeError("the expert never appeared in the DHT")
    [expert] = create_remote_experts(infos, dht)
    x0 = torch.randn(1, args.width)
    for _ in range(5):
        expert(x0)  # connection and first batches, unmeasured
    latencies, lock, stop = [], threading.Lock(), time.perf_counter() + args.seconds
    errors = []

    def loop(seed):
        x = torch.randn(1, args.width, generator=torch.Generator().manual_seed(seed))
        while time.perf_counter() < stop:
            t = time.perf_counter()
            try:
                with torch.no_grad():
                    expert(x)
            except Exception as exc:  # noqa: BLE001  (an anchor: count it and go on)
                errors.append(repr(exc)[:200])
                continue
            with lock:
                latencies.append(time.perf_counter() - t)

    started = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(args.callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    dht.shutdown()
    return {"rows_per_s": len(latencies) / wall, "p50_ms": 1000 * pct(latencies, 0.5),
            "p99_ms": 1000 * pct(latencies, 0.99), "calls": len(latencies), "errors": errors[:5],
            "error_count": len(errors)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--callers", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--deadline", type=float, default=300.0)
    ap.add_argument("--no-netns", action="store_true")
    ap.add_argument("--server", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.server:
        server(args)
        return 0
    signal.signal(signal.SIGALRM, lambda s, f: (_ for _ in ()).throw(TimeoutError("past --deadline")))
    signal.alarm(int(args.deadline))
    cmd = [sys.executable, os.path.abspath(__file__), "--server", "--width", str(args.width),
           "--max-batch", str(args.max_batch), "--no-netns"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        maddrs = json.loads(line)["maddrs"]
        res = caller(args, maddrs)
    finally:
        try:
            proc.stdin.close()
            proc.wait(10)
        except (subprocess.TimeoutExpired, OSError):
            os.killpg(proc.pid, signal.SIGKILL)
    signal.alarm(0)
    res.update(width=args.width, callers=args.callers, max_batch=args.max_batch,
               netns=os.environ.get("ANCHOR_BENCH_IN_NETNS") == "1")
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    if "--server" not in sys.argv and "--no-netns" not in sys.argv:
        sys.path.insert(0, ANCHORS)
        from _netns import reexec_in_loopback_netns

        reexec_in_loopback_netns(sys.argv)
    sys.exit(main())
