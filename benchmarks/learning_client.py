"""What a DiLoCo outer sync costs through a running daemon, against the same sync in-process.

    .venv/bin/python benchmarks/learning_client.py [--mib 64] [--syncs 5] [--warmup 2]

A group of one member (so the figure is the member's own work and the control
socket, no peers): ``DiLoCo(inner_steps=1)``, so each ``step()`` is one outer
sync (Δ, the all-reduce of a roster of one, the Nesterov step, the state hash,
the state offered to joiners).  In-process: a node opened in this process
(``meshd.open_node``).  Through a daemon: a ``meshd start`` process and
``meshd.connect`` (``RemoteDiLoCo``): the parameters go to the daemon over the
control socket and θ comes back, raw, every sync.  Two models: the digits MLP
(38 kB) and ``--mib`` MiB of float32 (4 MiB tensors).  Before each sync the
parameters move by noise, outside the timing.  Per row: the median and max
``step()`` of ``--syncs`` syncs after ``--warmup``, and for the daemon its RSS
before the session, after it, and its peak (``VmHWM``).
"""

from __future__ import annotations

import argparse
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


def big_model(mib: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.ParameterList([torch.nn.Parameter(torch.randn(MiB)) for _ in range(mib // 4)])


def _status(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
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
                        inner_steps=1)
        times = await _syncs(opt, model, args.warmup + args.syncs)
    return {"times": times[args.warmup:]}


async def through_daemon(make, args, tmp: Path, name: str) -> dict:
    daemon = Daemon(tmp / f"daemon-{name}", config=SERVICES).start()
    try:
        model = make()
        before = _status(daemon.proc.pid)
        async with meshd.connect(daemon.data_dir) as client:
            opt = ml.DiLoCo(client, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.0), group="bench",
                            inner_steps=1)
            await opt.start()
            times = await _syncs(opt, model, args.warmup + args.syncs)
            during = _status(daemon.proc.pid)
            await opt.aclose()
        return {"times": times[args.warmup:], "rss_before": before["VmRSS"], "rss_during": during["VmRSS"],
                "peak": during["VmHWM"]}
    finally:
        daemon.stop()


def _row(label: str, size: int, inproc: dict, remote: dict) -> str:
    med_i, med_r = statistics.median(inproc["times"]), statistics.median(remote["times"])
    moved = 2 * size  # parameters up, θ down
    return (f"| {label} | {size / 1e6:,.3f} | {med_i * 1e3:,.1f} (max {max(inproc['times']) * 1e3:,.1f}) | "
            f"{med_r * 1e3:,.1f} (max {max(remote['times']) * 1e3:,.1f}) | {(med_r - med_i) * 1e3:,.1f} | "
            f"{moved / max(med_r - med_i, 1e-9) / 1e6:,.0f} | {remote['rss_before'] / MiB:,.0f} / "
            f"{remote['rss_during'] / MiB:,.0f} / {remote['peak'] / MiB:,.0f} |")


async def main(args) -> None:
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, make in [("digits MLP", digits_mlp), (f"{args.mib} MiB float32", lambda: big_model(args.mib))]:
            size = sum(p.numel() * p.element_size() for p in make().parameters())
            inproc = await in_process(make, args, Path(tmp) / label.replace(" ", "-"))
            remote = await through_daemon(make, args, Path(tmp), label.replace(" ", "-"))
            rows.append(_row(label, size, inproc, remote))
    print("| model | MB | in-process sync ms | through the daemon ms | added ms | added MB/s (2x model) | "
          "daemon RSS MiB: before / in session / peak |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    trio.run(main, parser.parse_args())
