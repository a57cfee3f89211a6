"""In-process meshd nodes on 127.0.0.1 for node tests: the first is everyone's bootstrap."""

from __future__ import annotations

from contextlib import AsyncExitStack

import meshd


async def open_nodes(stack: AsyncExitStack, tmp_path, count: int, config: meshd.Config | None = None) -> list:
    """``count`` nodes in ``tmp_path``/n0.. (open until ``stack`` closes), each connected to the first."""
    first = await stack.enter_async_context(meshd.open_node(tmp_path / "n0", listen="127.0.0.1:0", config=config))
    rest = []
    for i in range(1, count):
        node = await stack.enter_async_context(meshd.open_node(
            tmp_path / f"n{i}", listen="127.0.0.1:0", bootstrap=[str(first.address)], config=config))
        await node.connect(first.address)
        rest.append(node)
    return [first, *rest]
