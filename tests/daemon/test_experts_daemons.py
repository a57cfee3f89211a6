"""``meshctl experts`` against a real daemon, with an expert served by a script's in-process node."""

from __future__ import annotations

import math
import signal
import time

import torch
import trio

import meshd
import meshd.experts as mx
from experts import hdee
from meshd.testing import experts_kit as kit
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


async def test_hdee_decoding_drops_an_expert_whose_server_process_is_sigkilled(tmp_path):
    """Three tiny LM experts, one served by a child process that is SIGKILLed (by pid) while
    the ensemble decodes: every step completes, says who answered, leaves the killed one out
    from the kill on, and mixes the others with their posterior renormalized among them."""
    started = time.perf_counter()
    lms = {f"lm-{i}": kit.CharLM(width=8, seed=i).eval() for i in range(3)}
    victim_id, kill_at, after = "lm-2", 6, 6  # kill during step 6; decode 6 steps after it
    survivors = ["lm-0", "lm-1"]
    text = kit.encode("Decoding goes on, one byte at a time, while an expert's server dies. " * 2)
    async with (meshd.open_node(tmp_path / "caller", listen="127.0.0.1:0") as caller,
                meshd.open_node(tmp_path / "server", listen="127.0.0.1:0", bootstrap=[str(caller.address)]) as server):
        await server.connect(str(caller.address))
        for e in survivors:
            await mx.serve(server, lms[e], expert_id=e, kind="lm")
        victim_spec = kit.ExpertSpec.of(lms[victim_id], victim_id, kind="lm")
        async with kit.expert_process(tmp_path / "victim", [victim_spec], bootstrap=str(caller.address)) as victim:
            ens = mx.HDEEEnsemble(caller, list(lms))
            for expert in ens.experts.values():  # each found and answering before decoding starts
                await expert.call(text[None, :4])
            reached, killed = trio.Event(), trio.Event()
            steps: list[tuple[bool, torch.Tensor, mx.Scored, dict]] = []  # (killed before it began, context, ...)
            codes = []

            async def kill() -> None:
                await reached.wait()  # the decoder has started step kill_at
                victim.kill()
                codes.append(await victim.wait())
                killed.set()

            async def decode() -> None:
                for t in range(2, len(text) + 1):
                    if len(steps) == kill_at:
                        reached.set()
                    before = killed.is_set()
                    _, scored = await ens.next_token_logprobs(text[:t])
                    steps.append((before, text[:t], scored, dict(ens.weights)))
                    if sum(s[0] for s in steps) == after:
                        return
                raise AssertionError("the text ran out before the decoder got past the kill")

            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(kill)
                    nursery.start_soon(decode)
    assert codes == [-signal.SIGKILL]
    for i, (before, context, scored, weights) in enumerate(steps):
        if i < kill_at:
            assert scored.answered == list(lms) and not scored.dropped, i
        elif before:  # from the kill on: left out, with a reason, the others renormalized
            assert scored.answered == survivors and victim_id in scored.dropped, i
        else:  # the step the kill fell in: either
            continue
        lp = torch.stack([kit.token_logprobs(lms[e], context).double() for e in scored.answered])
        mix, log_w = hdee.posterior_mixture(lp)
        assert torch.allclose(scored.logp.double(), mix, atol=1e-5), i
        final = torch.softmax(log_w[:, -1] + lp[:, -1], 0)
        assert list(weights) == scored.answered and math.isclose(sum(weights.values()), 1.0, rel_tol=1e-9)
        assert torch.allclose(torch.tensor([weights[e] for e in scored.answered], dtype=torch.float64), final,
                              atol=1e-5), i
    assert sum(before for before, *_ in steps) == after
    assert time.perf_counter() - started < 20


async def test_meshctl_experts_serve_has_the_daemon_serve_a_factorys_module_with_weights_from_a_file(
        daemons, tmp_path):  # noqa: F811
    """``meshctl experts serve FILE --factory MODULE:NAME``: the daemon imports the factory (and torch),
    loads the weights without unpickling, serves the module until ``unserve``; ``ls`` shows it with
    its health and, once called, the latency the daemon measured."""
    from safetensors.torch import save_file  # noqa: PLC0415

    a = daemons("a")
    (tmp_path / "tinymodels.py").write_text("import torch\n\n\ndef make(width=3):\n"
                                            "    return torch.nn.Linear(4, width)\n")
    torch.manual_seed(1)
    want = torch.nn.Linear(4, 5)
    save_file(want.state_dict(), str(tmp_path / "lin.safetensors"))
    factory = f"{tmp_path / 'tinymodels.py'}:make"
    info = a.meshctl("experts", "serve", str(tmp_path / "lin.safetensors"), "--factory", factory,
                     "--kwargs", '{"width": 5}', "--id", "lin5", "--domain", "test", timeout=120)
    assert info["expert"] == "lin5" and info["params"] == 25 and info["servers"] == [a.peer_id]
    [row] = a.meshctl("experts", "ls")
    assert row["expert"] == "lin5" and row["domain"] == "test" and row["health"] == "ok"
    x = [[0.5, -1.0, 2.0, 0.25]]
    [out] = a.meshctl("experts", "call", "lin5", str(x))["outputs"]
    assert torch.allclose(torch.tensor(out["values"]), want(torch.tensor(x)).detach(), atol=1e-6)
    [row] = a.meshctl("experts", "ls")
    assert row["latency_ms"] > 0 and row["peers"][0]["latency_from"] == "calls"
    table = a.meshctl_raw("experts", "ls").stdout
    assert "health" in table and "latency" in table and " ms" in table
    torch.save(want, tmp_path / "whole-module.pt")  # a pickled module, not a state_dict: refused, nothing run
    line = one_line_error(a.meshctl_raw("experts", "serve", str(tmp_path / "whole-module.pt"), "--factory",
                                        factory, "--id", "pickled", timeout=60))
    assert "weights-only" in line
    line = one_line_error(a.meshctl_raw("experts", "serve", str(tmp_path / "lin.safetensors"), "--factory",
                                        factory, "--id", "small"))  # width 3 by default: the weights do not fit
    assert "do not fit" in line
    assert a.meshctl("experts", "unserve", "lin5") == {"expert": "lin5", "served": False}
    assert a.meshctl("experts", "ls") == []
