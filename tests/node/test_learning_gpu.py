"""Training across peers with models on a GPU: the members' models live on CUDA, θ, the
outer momentum and everything an exchange moves live in host memory.

Needs a CUDA device: skipped without one (CI has none; docs/learning.md says where
and when these ran).  A member on the GPU and one on the CPU train in one group, so
a test also shows the two agree to the bit on what they exchange.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import torch
import trio

import meshd
import meshd.learning as ml
from learning_members import fast_config, tiny_model
from meshnodes import open_nodes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GROUP = "gpu"
DEVICES = ["cuda", "cpu"]  # member 0's model on the GPU, member 1's on the CPU


async def _train(opt, model: torch.nn.Module, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    for _ in range(steps):
        model(torch.randn(8, 16, generator=gen).to(device)).pow(2).mean().backward()
        await opt.step(samples=8)


async def _until_live(opts, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        for opt in opts:
            while len(opt.group.live()) < len(opts):
                await opt.group._heard.wait()


@pytest.mark.parametrize("fragments, compression", [(1, "none"), (1, "int8"), (2, "none")])
async def test_diloco_members_on_a_gpu_and_a_cpu_end_each_round_with_identical_state(tmp_path, fragments,
                                                                                     compression):
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 2, fast_config())
        models = [tiny_model(i).to(device) for i, device in enumerate(DEVICES)]
        opts = [ml.DiLoCo(node, model, inner_opt=torch.optim.AdamW(model.parameters(), 1e-2), group=GROUP,
                          inner_steps=4, fragments=fragments, compression=compression)
                for node, model in zip(nodes, models)]
        await _until_live(opts)
        async with trio.open_nursery() as nursery:
            for i, (opt, model) in enumerate(zip(opts, models)):
                nursery.start_soon(_train, opt, model, 12, i)
        assert opts[0].group.hash is not None and opts[0].group.hash == opts[1].group.hash
        # (Streaming: the last fragment's exchange, begun at the last step, lands at the next)
        assert all(opt.group.hash_round == (2 if fragments == 1 else 1) for opt in opts)
        assert all(r.contributors == 2 for opt in opts for r in opt.reports)
        for name, theta in opts[0].theta.items():
            assert theta.device.type == "cpu" and torch.equal(theta, opts[1].theta[name])
        assert all(t.device.type == "cpu" for t in opts[0].outer.momentum.values())
        assert next(models[0].parameters()).device.type == "cuda"  # the model stayed where it was
        if fragments == 1:  # the parameters hold θ after each outer step, on their own device
            for opt, model in zip(opts, models):
                assert all(torch.equal(p.detach().cpu(), opt.theta[n]) for n, p in model.named_parameters())


async def test_a_gossip_round_merges_a_gpu_members_parameters_with_the_others(tmp_path):
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 3, fast_config())
        models = [tiny_model(i).to(device) for i, device in enumerate(["cuda", "cuda", "cpu"])]
        avgs = [ml.GossipAverager(node, model, group=GROUP, rule="mean", partners=2, seed=i)
                for i, (node, model) in enumerate(zip(nodes, models))]
        for avg in avgs:
            avg.group.offer("params", 0, avg._named())
        await _until_live(avgs)
        before = [torch.cat([p.detach().cpu().flatten() for p in m.parameters()]) for m in models]
        report = await avgs[0].step()
        after = torch.cat([p.detach().cpu().flatten() for p in models[0].parameters()])
        assert report.merged == 2 and next(models[0].parameters()).device.type == "cuda"
        assert torch.allclose(after, torch.stack(before).mean(dim=0), atol=1e-6)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "socket"])
async def test_a_script_with_its_model_on_a_gpu_syncs_through_its_node(tmp_path, shared):
    """A training script's model on the GPU, its member in the node (the control socket's session):
    after each sync the model holds the member's θ."""
    async with meshd.open_node(tmp_path / "n", listen="127.0.0.1:0", config=fast_config()) as node:
        async with meshd.connect(tmp_path / "n") as client:
            model = tiny_model(0).to("cuda")
            opt = ml.DiLoCo(client, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.1), group=GROUP,
                            inner_steps=2, shared_memory=shared)
            await _train(opt, model, 4, seed=0)
            assert (opt.hash_round, opt.round) == (1, 2)
            assert opt.memory == ("shared" if shared else "socket")
            member = node.service("learning").sessions[GROUP].opt
            assert next(model.parameters()).device.type == "cuda"
            assert all(torch.equal(p.detach().cpu(), member.theta[n]) for n, p in model.named_parameters())
            await opt.aclose()
