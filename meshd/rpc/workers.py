"""Tasks that serve calls, kept from one call to the next.

trio's ``start_soon`` puts ~5 µs (a task, its context, nursery bookkeeping)
on the path of every served call, before its reply can leave.  A worker
that has served a call waits for the next instead (up to ``idle`` of them
wait), and handing it one is a reschedule.  Each call runs in a fresh copy
of the submitting task's context, as a task spawned for it would, so a
handler's context variables never reach the next call.
"""

from __future__ import annotations

import contextvars
from typing import Any, Awaitable, Callable

import outcome
import trio


class Workers:
    """Runs ``serve(*args)`` for each :meth:`submit`, in the tasks of ``nursery``."""

    def __init__(self, nursery: trio.Nursery, serve: Callable[..., Awaitable[None]], *, idle: int = 8):
        self._nursery = nursery
        self._serve = serve
        self._most_idle = idle
        self._idle: list[trio.lowlevel.Task] = []

    @property
    def waiting(self) -> int:
        """Workers waiting for a call."""
        return len(self._idle)

    def submit(self, *args: Any) -> None:
        """Serve ``args`` now: in a waiting worker, or a new task if none waits."""
        if self._idle:
            worker = self._idle.pop()
            worker.context = contextvars.copy_context()
            trio.lowlevel.reschedule(worker, outcome.Value(args))
        else:
            self._nursery.start_soon(self._work, args)

    async def _work(self, args: tuple) -> None:
        task = trio.lowlevel.current_task()
        while True:
            await self._serve(*args)
            if len(self._idle) >= self._most_idle:
                return
            self._idle.append(task)

            def abort(_: object) -> trio.lowlevel.Abort:  # cancelled while waiting (the node stops)
                self._idle.remove(task)
                return trio.lowlevel.Abort.SUCCEEDED

            args = await trio.lowlevel.wait_task_rescheduled(abort)
