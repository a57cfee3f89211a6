"""The tasks that serve calls, kept between calls (meshd.rpc.workers), in one trio run."""

import contextvars

import trio
import trio.testing

from meshd.rpc.workers import Workers

SEEN = contextvars.ContextVar("seen", default="unset")


async def test_calls_one_after_another_are_served_by_one_task_each_in_a_fresh_context():
    tasks, values = [], []

    async def serve(n):
        tasks.append(trio.lowlevel.current_task())
        values.append(SEEN.get())
        SEEN.set(f"set by call {n}")  # must not reach the next call

    async with trio.open_nursery() as nursery:
        workers = Workers(nursery, serve)
        for n in range(20):
            workers.submit(n)
            await trio.testing.wait_all_tasks_blocked()
        assert workers.waiting == 1
        nursery.cancel_scope.cancel()  # the waiting worker ends with the nursery
    assert len(set(tasks)) == 1 and len(tasks) == 20
    assert values == ["unset"] * 20


async def test_at_most_idle_workers_wait_after_a_burst():
    release, done = trio.Event(), []

    async def serve(n):
        await release.wait()
        done.append(n)

    async with trio.open_nursery() as nursery:
        workers = Workers(nursery, serve, idle=8)
        for n in range(64):
            workers.submit(n)
        await trio.testing.wait_all_tasks_blocked()
        assert workers.waiting == 0  # all 64 busy, each in its own task
        release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(done) == list(range(64)) and workers.waiting == 8
        nursery.cancel_scope.cancel()
    assert workers.waiting == 0  # cancelled while waiting: each left the list
