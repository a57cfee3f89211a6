"""In-process nodes for scripts, benchmarks and tests that need one they can stop at will."""

from __future__ import annotations

from pathlib import Path

import trio

from ..daemon import open_node


async def node_until_cancelled(path: Path, bootstrap: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run a node in ``path`` on 127.0.0.1, connected to ``bootstrap``, until the cancel
    scope it hands out with it (``node, scope = await nursery.start(...)``) is cancelled:
    the node then stops as a killed one looks to its peers, its connections closed."""
    with trio.CancelScope() as scope:
        async with open_node(path, listen="127.0.0.1:0", bootstrap=[bootstrap]) as node:
            await node.connect(bootstrap)
            task_status.started((node, scope))
            await trio.sleep_forever()
