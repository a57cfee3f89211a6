"""A training group's membership document across in-process meshd nodes (real QUIC, real crdt service).

Members of a group end on one document, each sees the others' entries (role,
join time, throughput), a member that leaves reads as left and one that
stops as quiet, an entry another member wrote is rejected, and a node without
the crdt service has no document and says so.  Conditions are waited on
(changes to the document, this member's own writes), bounded by timeouts.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from contextlib import AsyncExitStack

import torch
import trio

import meshd
import meshd.learning as ml
from cli.commands import learning as learning_cli
from meshd.services.learning import LearningSection
from meshd.services.learning.membership import MEMBERS
from meshnodes import open_nodes

GROUP = "run42"
HEARTBEAT = 0.1  # entries are written every 10 heartbeats (1 s) and read as quiet after 3 s


def _config() -> meshd.Config:
    config = meshd.Config()
    config.learning = LearningSection(heartbeat_interval=HEARTBEAT, discover_interval=0.3, round_timeout_min=2.0)
    return config


def _membership(node):
    return node.service("learning").memberships[GROUP]


async def _until(node, condition, timeout: float = 30.0) -> None:
    """Return once ``condition()`` holds, looking again at every change to ``node``'s
    membership document and at every entry ``node`` writes (which also follows it to
    another document); trio.TooSlowError after ``timeout`` seconds."""
    membership = _membership(node)
    crdt = node.services.get("crdt")
    with trio.fail_after(timeout):
        while True:
            written, replica = membership.updated, membership.replica
            with contextlib.ExitStack() as stack:
                watcher = stack.enter_context(crdt.subscribe(replica)) if crdt and replica is not None else None
                if condition():
                    return
                async with trio.open_nursery() as nursery:
                    async def wake(wait) -> None:
                        with contextlib.suppress(trio.EndOfChannel):
                            await wait()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(wake, written.wait)
                    if watcher is not None:
                        nursery.start_soon(wake, watcher.events.receive)


def _entries(node) -> dict:
    return _membership(node).entries()[0]


class _Client:
    """What ``meshctl learning`` asks the daemon, answered by a node's control methods."""

    def __init__(self, node):
        self._control = node.service("learning").control_methods()

    async def learning_groups(self) -> list[dict]:
        return await self._control["learning.ls"]({}, None)

    async def learning_status(self, group: str) -> dict:
        return await self._control["learning.status"]({"group": group}, None)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


async def _train(opt, model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    while True:
        model(torch.randn(16, 8, generator=gen)).pow(2).mean().backward()
        await opt.step(samples=16)


async def test_members_see_each_others_entries_with_role_and_throughput(tmp_path):
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 3, _config())
        models = [_model(seed=i) for i in range(3)]
        started = time.time()
        opts = [ml.DiLoCo(node, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.05),
                          group=GROUP, inner_steps=3) for node, model in zip(nodes, models)]
        peers = {str(node.peer_id) for node in nodes}
        with trio.fail_after(10):  # the group first: members that start training alone part ways
            for node in nodes:
                group = node.service("learning").groups[GROUP]
                while len(group.live()) < len(nodes):
                    await group._heard.wait()

        def all_contributing(node) -> bool:
            rows = _entries(node)
            return set(rows) == peers and all(
                r["role"] == "contributor" and r["samples_s"] > 0 and r["steps_s"] > 0 and r["state"] == "live"
                for r in rows.values())

        async with trio.open_nursery() as nursery:
            for i, (opt, model) in enumerate(zip(opts, models)):
                nursery.start_soon(_train, opt, model, i)
            for node in nodes:
                await _until(node, lambda: all_contributing(node))
            nursery.cancel_scope.cancel()

        assert len({_membership(node).ref for node in nodes}) == 1  # one document, owned by a member
        assert _membership(nodes[0]).owner in {node.peer_id.key for node in nodes}
        for node in nodes:
            for row in _entries(node).values():
                assert started - 1 <= row["joined"] <= time.time() and row["island"] == 1
        control = nodes[0].service("learning").control_methods()
        status = await control["learning.status"]({"group": GROUP}, None)
        assert status["membership"]["writer"] and status["membership"]["entries"]["live"] == 3
        assert status["membership"]["rejected"] == 0 and status["membership"]["note"] is None
        rows = {m["peer"]: m for m in status["members"]}
        assert set(rows) == peers
        assert all(m["role"] == "contributor" and m["samples_s"] > 0 and m["state"] == "live" for m in rows.values())
        [summary] = await control["learning.ls"]({}, None)
        assert summary["known"] == {"live": 3, "quiet": 0, "left": 0}


async def test_a_member_that_leaves_reads_as_left_and_one_that_stops_as_quiet(tmp_path, capsys):
    async with AsyncExitStack() as stack:
        [a, b] = await open_nodes(stack, tmp_path / "ab", 2, _config())
        async with AsyncExitStack() as c_stack:
            c = await c_stack.enter_async_context(meshd.open_node(
                tmp_path / "c", listen="127.0.0.1:0", bootstrap=[str(a.address)], config=_config()))
            await c.connect(a.address)
            for node in (a, b, c):
                node.service("learning").join(GROUP, algorithm="diloco", rule="mean")
            peers = {str(n.peer_id) for n in (a, b, c)}
            for node in (a, b, c):
                await _until(node, lambda: set(_entries(node)) == peers)
            assert {r["role"] for r in _entries(a).values()} == {"joining"}

            b.service("learning").leave(GROUP)
            await _until(a, lambda: _entries(a)[str(b.peer_id)]["state"] == "left")
        # c's node is gone without leaving: its entry stops being refreshed
        await _until(a, lambda: _entries(a)[str(c.peer_id)]["state"] == "quiet", timeout=20)
        rows = _entries(a)
        assert rows[str(a.peer_id)]["state"] == "live" and set(rows) == peers  # nobody deleted anything
        control = a.service("learning").control_methods()
        [summary] = await control["learning.ls"]({}, None)
        assert summary["known"] == {"live": 1, "quiet": 1, "left": 1}
        status = await control["learning.status"]({"group": GROUP}, None)
        states = {m["peer"]: m["state"] for m in status["members"]}
        assert states == {str(a.peer_id): "live", str(b.peer_id): "left", str(c.peer_id): "quiet"}
        for command in (learning_cli.cmd_ls, learning_cli.cmd_status):  # meshctl prints gone members' rows too
            info, show = await command(_Client(a), argparse.Namespace(group=GROUP))
            show()
        out = capsys.readouterr().out
        assert out.rstrip().endswith(f"membership document {status['membership']['document']} (writer)")


class _NoisyDiLoCo(ml.DiLoCo):
    """A bad member: sends noise 20 times the size of its honest pseudo-gradient."""

    def _delta(self, p: int) -> torch.Tensor:
        honest = super()._delta(p)
        noise = torch.randn(honest.shape, generator=torch.Generator().manual_seed(self.steps))
        return noise * (20 * honest.norm() / noise.norm())


async def test_the_group_reports_a_member_its_reducers_keep_clipping(tmp_path, capsys):
    """Each member writes whom its rule clipped into its entry; status sums them over the group."""
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 4, _config())
        models = [_model(seed=0) for _ in nodes]
        opts = [(_NoisyDiLoCo if i == 3 else ml.DiLoCo)(
                    node, model, inner_opt=torch.optim.SGD(model.parameters(), lr=0.05), group=GROUP,
                    inner_steps=2, rule="trimmed_mean") for i, (node, model) in enumerate(zip(nodes, models))]
        bad = str(nodes[3].peer_id)
        with trio.fail_after(10):
            for node in nodes:
                group = node.service("learning").groups[GROUP]
                while len(group.live()) < len(nodes):
                    await group._heard.wait()

        def reported() -> bool:  # most of the other members' entries find it a suspect, all of them live here
            from learn.membership import clipped_by_group
            entries = _entries(nodes[0])
            live = sum(row["state"] == "live" for row in entries.values())
            return live == len(nodes) and 2 * clipped_by_group(entries).get(bad, (0, 0, 0))[2] > 3

        async with trio.open_nursery() as nursery:
            for i, (opt, model) in enumerate(zip(opts, models)):
                nursery.start_soon(_train, opt, model, i)
            await _until(nodes[0], reported)
            nursery.cancel_scope.cancel()

        status = await nodes[0].service("learning").control_methods()["learning.status"]({"group": GROUP}, None)
        rows = {m["peer"]: m for m in status["members"]}
        assert rows[bad]["group_suspect"] and rows[bad]["suspected_by"] >= 2 and rows[bad]["voters"] == 3
        assert 3 <= rows[bad]["group_clipped"] <= rows[bad]["group_used"]
        assert not any(m["group_suspect"] for peer, m in rows.items() if peer != bad)
        cells = {peer: learning_cli._clipped(m) for peer, m in rows.items()}  # meshctl's column
        assert cells[bad].endswith("SUSPECT") and f"suspect to {rows[bad]['suspected_by']} of 3" in cells[bad]
        assert not any("SUSPECT" in cell for peer, cell in cells.items() if peer != bad)
        info, show = await learning_cli.cmd_status(_Client(nodes[0]), argparse.Namespace(group=GROUP))
        show()
        assert "SU" in capsys.readouterr().out  # in the table (rich may cut it short at this width)


async def test_an_entry_another_member_wrote_is_rejected(tmp_path):
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 3, _config())
        for node in nodes:
            node.service("learning").join(GROUP, algorithm="diloco", rule="mean")
        peers = {str(n.peer_id) for n in nodes}
        for node in nodes:
            await _until(node, lambda: set(_entries(node)) == peers)
        [reader, forger, victim] = nodes
        victim.service("learning").leave(GROUP)  # its last entry says it left; it writes no more
        for node in (reader, forger):  # the forger's write comes after the last one, and wins the register
            await _until(node, lambda: _entries(node)[str(victim.peer_id)]["state"] == "left")
        forged = {**_entries(reader)[str(victim.peer_id)], "left": None, "role": "contributor", "seen": time.time()}
        forged.pop("state")
        forger.service("crdt").write(_membership(forger).replica,
                                     lambda tx: tx.set([MEMBERS, str(victim.peer_id)], forged))
        await _until(reader, lambda: _membership(reader).entries()[1] == 1)
        assert str(victim.peer_id) not in _entries(reader)  # hidden until its member writes again, never forged
        status = await reader.service("learning").control_methods()["learning.status"]({"group": GROUP}, None)
        assert status["membership"]["rejected"] == 1


async def test_members_that_started_documents_of_their_own_end_on_the_lowest_ones(tmp_path):
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(meshd.open_node(tmp_path / "a", listen="127.0.0.1:0", config=_config()))
        b = await stack.enter_async_context(meshd.open_node(tmp_path / "b", listen="127.0.0.1:0", config=_config()))
        for node in (a, b):
            node.service("learning").join(GROUP, algorithm="gossip", rule="mean")
        for node in (a, b):  # alone, each starts its own
            await _until(node, lambda: str(node.peer_id) in _entries(node))
        assert _membership(a).ref != _membership(b).ref
        await b.connect(a.address)
        b.service("learning").groups[GROUP].heard_of(a.peer_id.key)  # as the DHT would tell it
        low = min((a, b), key=lambda n: n.peer_id.key)
        for node in (a, b):
            await _until(node, lambda: set(_entries(node)) == {str(a.peer_id), str(b.peer_id)})
            assert _membership(node).owner == low.peer_id.key


async def test_without_the_crdt_service_there_is_no_document_and_status_says_so(tmp_path, capsys):
    async with meshd.open_node(tmp_path / "n", listen="127.0.0.1:0", config=_config(),
                               services=["dht", "learning"]) as node:
        learning = node.service("learning")
        group = learning.join(GROUP, algorithm="diloco", rule="mean")
        membership = learning.membership(GROUP)
        membership.report(steps=4, samples=64, role="follower")
        await group.settled.wait()
        await membership.step()  # what a heartbeat does: nothing to open, nothing to write
        control = learning.control_methods()
        status = await control["learning.status"]({"group": GROUP}, None)
        assert status["membership"]["document"] is None and "crdt service is off" in status["membership"]["note"]
        [me] = status["members"]
        assert me["me"] and me["role"] == "follower" and me["state"] is None  # its own, measured here
        [summary] = await control["learning.ls"]({}, None)
        assert summary["known"] is None
        info, show = await learning_cli.cmd_status(_Client(node), argparse.Namespace(group=GROUP))
        show()
        assert "no membership document: the crdt service is off" in capsys.readouterr().out
