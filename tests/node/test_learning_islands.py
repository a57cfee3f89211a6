"""Islands: groups of torch.distributed (gloo) processes whose rank 0 trains in a meshd group.

Two islands of two real processes each (``tests/support/island_worker.py``,
forked by ``meshd.testing.run_ranks``), each island its own gloo process
group on 127.0.0.1; the rank-0 processes open in-process meshd nodes
bootstrapped to one this test runs, and train one model with
``IslandDiLoCo``.  The islands start from different inits, so one takes the
other's state when it joins and broadcasts it to its rank 1.
"""

from __future__ import annotations

import functools

import pytest
import trio

import meshd
from meshd.services.learning import LearningSection
from meshd.testing.ranks import run_ranks

from island_worker import island_rank

ISLANDS, SIZE, H, STEPS, CHECK_AT = 2, 2, 5, 15, 7  # three outer rounds; step 7 is mid-round


@pytest.mark.parametrize("rank0", ["node", "daemon"])
async def test_two_islands_of_two_gloo_processes_end_with_one_model(tmp_path, rank0):
    """``rank0="daemon"``: island 1's rank 0 opens no node; the bootstrap node, running in this
    test's process as a daemon would, is its member, through a client of its control socket."""
    config = meshd.Config()
    config.learning = LearningSection(heartbeat_interval=0.2, discover_interval=0.5, round_timeout_min=5.0)
    async with meshd.open_node(tmp_path / "boot", listen="127.0.0.1:0", config=config) as boot:
        daemon = {1: str(tmp_path / "boot")} if rank0 == "daemon" else {}
        calls = [(functools.partial(island_rank, islands=ISLANDS, store=str(tmp_path / f"island{i}.store"),
                                    bootstrap=str(boot.address), data_dir=str(tmp_path / f"island{i}"),
                                    steps=STEPS, inner_steps=H, check_at=CHECK_AT, daemon=daemon.get(i)),
                  (i, rank, SIZE))
                 for i in range(ISLANDS) for rank in range(SIZE)]
        with trio.fail_after(60):  # past it, every rank is killed
            results = await run_ranks(calls, tmp_path, preload=("island_worker",))
    by = {(r["island"], r["rank"]): r for r in results}
    heads = [by[i, 0] for i in range(ISLANDS)]

    # every rank of every island holds the same parameters, bit for bit
    assert len({r["final"] for r in results}) == 1
    # mid-round, DDP alone keeps an island's ranks identical, and the islands apart
    assert all(by[i, 0]["mid"] == by[i, 1]["mid"] for i in range(ISLANDS))
    assert by[0, 0]["mid"] != by[1, 0]["mid"]
    # the rank 0s agree on the group's state (θ and outer momentum) after the last round
    assert len({h["state_hash"] for h in heads}) == 1 and heads[0]["state_hash"] is not None
    assert all(h["hash_round"] == STEPS // H - 1 for h in heads)
    assert all(h["contributors"] == [ISLANDS] * (STEPS // H) and h["missing"] == 0 for h in heads)
    # rank 0 speaks for the island's samples: H steps × 16 samples × 2 ranks a round
    # (a node that ran its own member saw each member's samples in its last round; a daemon's status,
    # asked after the other island left, may list only its own: the other island's view shows it)
    assert all(by[i, 0]["samples"] == [H * 16 * SIZE] * ISLANDS for i in range(ISLANDS) if i not in daemon)
    assert all(h["island_size"] == SIZE for h in heads)  # and the membership document says how many ranks
    # rank 1 took rank 0's parameters after every outer step, and once more on the island that joined
    assert all(by[i, 1]["broadcasts"] == by[i, 0]["broadcasts"] for i in range(ISLANDS))
    assert sorted(h["broadcasts"] for h in heads) == [STEPS // H, STEPS // H + 1]
    # only the rank 0s are in the mesh: they built the only nodes, and the group is the two of them
    assert [by[i, rank]["nodes_built"] for i in range(ISLANDS) for rank in range(SIZE)] == \
        [1, 0] * ISLANDS if rank0 == "node" else [1, 0, 0, 0]
    assert all(set(h["members"]) == {h["peer"] for h in heads} for h in heads)
