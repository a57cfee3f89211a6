"""``meshctl experts`` against a real daemon, with an expert served by a script's in-process node."""

from __future__ import annotations

import torch
import trio

import meshd
import meshd.experts as mx
from meshd.testing.localmesh import wait_until
from test_daemons import daemons, one_line_error  # noqa: F401  (the fixture)


async def test_meshctl_finds_and_calls_an_expert_a_script_serves(daemons, tmp_path):  # noqa: F811
    a = daemons("a")
    assert a.meshctl("experts", "ls") == []
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    async with meshd.open_node(tmp_path / "script", listen="127.0.0.1:0", bootstrap=[str(a.address)]) as node:
        await node.connect(str(a.address))
        await mx.serve(node, module, expert_id="lin", domain="test")

        def found() -> bool:
            rows = a.meshctl("experts", "ls", "--find", "lin")
            return bool(rows and rows[0].get("servers"))

        await trio.to_thread.run_sync(wait_until, found, 15, "the daemon to find expert lin")
        [row] = await trio.to_thread.run_sync(a.meshctl, "experts", "ls", "--find", "lin")
        assert row["servers"] == [str(node.peer_id)] and row["kind"] == "module" and row["params"] == 15
        x = [[0.5, -1.0, 2.0, 0.25]]
        reply = await trio.to_thread.run_sync(a.meshctl, "experts", "call", "lin", str(x))
        [out] = reply["outputs"]
        assert reply["peer"] == str(node.peer_id) and out["shape"] == [1, 3]
        assert torch.allclose(torch.tensor(out["values"]), module(torch.tensor(x)).detach(), atol=1e-6)
        line = one_line_error(await trio.to_thread.run_sync(a.meshctl_raw, "experts", "call", "lin", "[[1, 2]]"))
        assert "[batch, 4]" in line or "shape" in line or "size" in line
    line = one_line_error(a.meshctl_raw("experts", "call", "nobody", "[1]"))
    assert "nobody serves expert 'nobody'" in line
    bad = a.meshctl_raw("experts", "call", "lin", "[1, [2]]")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "same shape" in bad.stderr
