"""Wait for a condition in one trio run without sleeping: until nothing else can run."""

import trio.testing


async def settle(until) -> None:
    """Return once ``until()`` is true, checking each time every other task is blocked."""
    while not until():
        await trio.testing.wait_all_tasks_blocked()
