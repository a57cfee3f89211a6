"""Training ranks as real processes, forked from one that imported torch once.

Every process of a torch.distributed job imports torch, and
``DistributedDataParallel`` pulls in ``torch._dynamo`` as well: seconds of CPU
each, which four processes on a small machine pay four times over.
:func:`run_ranks` starts its processes from multiprocessing's fork server,
which imports those modules once, so each rank starts in milliseconds.  The
caller stays a trio program (a meshd node may run in it meanwhile); the fork
server is started with fork+exec, so nothing of the caller's trio state is
forked.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Callable

import trio

PRELOAD = ("torch", "torch._dynamo", "torch.nn.parallel", "torch.distributed", "trio", "meshd.learning")


class RankFailed(Exception):
    """A rank's process exited with an error (its traceback went to stderr)."""


async def run_ranks(calls: list[tuple[Callable[..., dict], tuple]], workdir: Path, *,
                    preload: tuple[str, ...] = ()) -> list[dict]:
    """Run each ``fn(*args)`` of ``calls`` in a process of its own, all at once,
    and return what they returned (JSON-able dicts), in order.

    ``fn`` must be importable by name (a module's top level); ``preload``
    names modules the fork server imports beside :data:`PRELOAD` (the
    functions' own modules; ``"__main__"`` for a script's), which only counts
    when this process starts its fork server, at the first call.  If a rank
    fails, or the caller is cancelled, every rank's process is killed before
    this returns.  Results go through files in ``workdir``.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *preload])
    outs = [Path(workdir) / f"rank{i}.json" for i in range(len(calls))]
    procs: list = []
    try:
        for (fn, args), out in zip(calls, outs):
            proc = ctx.Process(target=_child, args=(fn, args, str(out)), daemon=True)
            proc.start()
            procs.append(proc)
        async with trio.open_nursery() as nursery:
            for i, proc in enumerate(procs):
                nursery.start_soon(_wait, i, proc)
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in procs:
            proc.join()
    return [json.loads(out.read_text()) for out in outs]


async def _wait(index: int, proc) -> None:
    await trio.lowlevel.wait_readable(proc.sentinel)
    proc.join()
    if proc.exitcode != 0:
        raise RankFailed(f"rank process {index} exited with {proc.exitcode}")


def _child(fn: Callable[..., dict], args: tuple, out: str) -> None:
    Path(out).write_text(json.dumps(fn(*args)))
