"""What a DiLoCo outer sync costs through a running daemon, against the same sync in-process.

    .venv/bin/python benchmarks/learning_client.py [--mib 64] [--syncs 5] [--warmup 2] [--threads 1]
                                                   [--fragments 1]

A group of one member (so the figure is the member's own work and the control
socket, no peers): ``DiLoCo(inner_steps=1)``, so each ``step()`` is one outer
sync (Δ, the all-reduce of a roster of one, the Nesterov step, the state hash,
the state offered to joiners); with ``--fragments P``, Streaming DiLoCo with
H = P, so each ``step()`` starts one fragment's exchange and lands the one
started a step before (a Pth of the model each).  In-process: a node opened in
this process (``meshd.open_node``).  Through a daemon: a ``meshd start``
process and ``meshd.connect`` (``RemoteDiLoCo``), two ways in the same run,
each with a daemon of its own: over the socket (``shared_memory=False``: the
parameters go to the daemon over the control socket and θ comes back, raw,
every sync) and over shared memory (the default: the script copies its
parameters into the shadow both processes map, and θ out of it).  Two models:
the digits MLP (38 kB) and ``--mib`` MiB of float32 (4 MiB tensors).  Before
each sync the parameters move by noise, outside the timing.  Per row: the
median and max ``step()`` of ``--syncs`` syncs after ``--warmup``, and for
each daemon its RSS before the session, during it, and its peak (``VmHWM``);
with shared memory the daemon's RSS counts the shadow's pages it touched
(``RssShmem``, shown apart), which the script's RSS counts too: one copy in
memory, not two. Every process runs torch with ``--threads`` threads (the
script's ``torch.set_num_threads``, the daemons' ``OMP_NUM_THREADS``): on a
small machine under load, a daemon left at torch's default (a thread per core)
took 3-5x longer over its own part of a sync than with one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:1] = [str(REPO)]

import torch  # noqa: E402
import trio  # noqa: E402

import meshd  # noqa: E402
import meshd.learning as ml  # noqa: E402
from meshd.testing.localmesh import Daemon  # noqa: E402

MiB = 1 << 20
SERVICES = {"node": {"services": ["dht", "learning"]}}


def digits_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


class _Layer(torch.nn.Module):
    """One 4 MiB float32 tensor, a layer of its own (so Streaming DiLoCo can stride them)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(MiB))


def big_model(mib: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.ModuleList([_Layer() for _ in range(mib // 4)])


def _status(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssShmem"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


async def _syncs(opt, model: torch.nn.Module, count: int) -> list[float]:
    times = []
    gen = torch.Generator().manual_seed(1)
    for _ in range(count):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen), alpha=1e-3)
        started = time.perf_counter()
        await opt.step()
        times.append(time.perf_counter() - started)
    return times


async def in_process(make, args, tmp: Path) -> dict:
    config = meshd.Config()
    config.update(SERVICES)
    model = make()
    async with meshd.open_node(tmp / "inproc", listen="127.0.0.1:0", config=config) as node:
        opt = ml.DiLoCo(node, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.0), group="bench",
                        inner_steps=args.fragments, fragments=args.fragments)
        times = await _syncs(opt, model, args.warmup + args.syncs)
    return {"times": times[args.warmup:]}


async def through_daemon(make, args, tmp: Path, name: str, *, shared: bool) -> dict:
    daemon = Daemon(tmp / f"daemon-{name}-{'shared' if shared else 'socket'}", config=SERVICES,
                    env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}).start()
    try:
        model = make()
        before = _status(daemon.proc.pid)
        async with meshd.connect(daemon.data_dir) as client:
            opt = ml.DiLoCo(client, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.0), group="bench",
                            inner_steps=args.fragments, fragments=args.fragments, shared_memory=shared)
            await opt.start()
            if opt.memory != ("shared" if shared else "socket"):
                raise SystemExit(f"the session went over the {opt.memory}: {opt.memory_why}")
            times = await _syncs(opt, model, args.warmup + args.syncs)
            during = _status(daemon.proc.pid)
            await opt.aclose()
        return {"times": times[args.warmup:], "rss_before": before["VmRSS"], "rss_during": during["VmRSS"],
                "shmem": during.get("RssShmem", 0), "peak": during["VmHWM"]}
    finally:
        daemon.stop()


def _ms(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:,.1f} (max {max(times) * 1e3:,.1f})"


def _row(label: str, size: int, inproc: dict, socket: dict, shared: dict) -> str:
    med_i = statistics.median(inproc["times"])
    added = {k: statistics.median(r["times"]) - med_i for k, r in (("socket", socket), ("shared", shared))}

    def rss(r: dict) -> str:
        shmem = f" ({r['shmem'] / MiB:,.1f} shared)" if r["shmem"] else ""
        return f"{r['rss_before'] / MiB:,.0f} / {r['rss_during'] / MiB:,.0f}{shmem} / {r['peak'] / MiB:,.0f}"

    return (f"| {label} | {size / 1e6:,.3f} | {_ms(inproc['times'])} | {_ms(socket['times'])} | "
            f"{_ms(shared['times'])} | {added['socket'] * 1e3:,.1f} / {added['shared'] * 1e3:,.1f} | "
            f"{rss(socket)} | {rss(shared)} |")


async def main(args) -> None:
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, make in [("digits MLP", digits_mlp), (f"{args.mib} MiB float32", lambda: big_model(args.mib))]:
            layers = sum(1 for m in make().modules() if not list(m.children()) and list(m.parameters()))
            if args.fragments > layers:
                print(f"{label}: skipped, {layers} layers cannot make {args.fragments} fragments", flush=True)
                continue
            size = sum(p.numel() * p.element_size() for p in make().parameters())
            name = label.replace(" ", "-")
            inproc = await in_process(make, args, Path(tmp) / name)
            socket = await through_daemon(make, args, Path(tmp), name, shared=False)
            shared = await through_daemon(make, args, Path(tmp), name, shared=True)
            rows.append(_row(label, size, inproc, socket, shared))
    print("| model | MB | in-process sync ms | daemon, socket ms | daemon, shared memory ms | "
          "added ms: socket / shared | daemon RSS MiB, socket: before / in session / peak | "
          "daemon RSS MiB, shared memory: before / in session / peak |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, in the script and the daemons")
    parser.add_argument("--fragments", type=int, default=1,
                        help="P > 1: Streaming DiLoCo with H = P (every step starts one fragment's exchange "
                             "and lands the one before)")
    trio.run(main, parser.parse_args())
