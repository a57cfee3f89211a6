"""A training script's session with its node, in one process: the node's control socket, a RemoteDiLoCo.

tests/daemon/test_learning_client.py runs the real thing (a daemon process
among in-process members); here the node is in-process so the test can reach
the session's DiLoCo and make it take another member's state between two of
the script's syncs, as the hash check does.
"""

from __future__ import annotations

import torch

import meshd
import meshd.learning as ml
from learning_members import fast_config, tiny_model

H = 2


async def _steps(opt, model: torch.nn.Module, count: int, gen: torch.Generator) -> None:
    for _ in range(count):
        model(torch.randn(4, 16, generator=gen)).pow(2).mean().backward()
        await opt.step(samples=4)


async def test_a_state_taken_between_two_syncs_replaces_the_scripts_stale_steps(tmp_path):
    """The script's parameters after the take were trained from the old θ: the daemon drops them,
    runs no exchange, and hands back the state it took (θ and the step count of its round);
    the sync after that is an ordinary one."""
    gen = torch.Generator().manual_seed(0)
    async with meshd.open_node(tmp_path / "n", listen="127.0.0.1:0", config=fast_config()) as node:
        async with meshd.connect(tmp_path / "n") as client:
            model = tiny_model(0)
            opt = ml.DiLoCo(client, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.1), group="g",
                            inner_steps=H)
            await _steps(opt, model, H, gen)  # round 0, alone
            assert (opt.hash_round, opt.round, opt.steps, len(opt.reports)) == (0, 1, H, 1)
            member = node.service("learning").sessions["g"].opt
            assert all(torch.equal(p.detach(), member.theta[n]) for n, p in model.named_parameters())

            taken = {**{f"theta/{n}": t + 1 for n, t in member.theta.items()},
                     **{f"momentum/{n}": torch.zeros_like(t) for n, t in member.theta.items()}}
            theta = {n: taken[f"theta/{n}"].clone() for n in member.theta}  # _apply adopts the tensors themselves
            member._apply(node.peer_id.key, 5, taken, path="pull", seconds=0.0)  # as a resync does
            await _steps(opt, model, H, gen)  # trained from the old θ: dropped
            assert opt.resyncs == 1 and opt.steps == 5 * H and opt.round == 5 and len(opt.reports) == 1
            for name, param in model.named_parameters():
                assert torch.equal(param.detach(), theta[name]), name

            await _steps(opt, model, H, gen)  # round 5, from the state taken
            assert (opt.hash_round, opt.round, [r.round for r in opt.reports]) == (5, 6, [0, 5])
            assert opt.hash == member.group.hash
            assert all(torch.equal(p.detach(), member.theta[n]) for n, p in model.named_parameters())
            assert not any(torch.equal(p.detach(), theta[n]) for n, p in model.named_parameters())
            await opt.aclose()
            assert "g" not in node.service("learning").groups
