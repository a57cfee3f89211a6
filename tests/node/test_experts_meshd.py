"""Experts served by in-process meshd nodes and called over real QUIC on loopback.

A served module answers remote calls with the values it gives in process,
batching concurrent calls; a caller coalesces its concurrent calls into
fewer requests, each caller getting its own rows, or the request's error;
bad calls get clear errors and cost nothing
else; a caller hedges a slow server and fails over from a gone one; the
HDEE and DDM ensembles over the mesh give what the same mixing gives in one
process, and leave out an expert that dies.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AsyncExitStack

import pytest
import torch
import trio
import trio.testing

import meshd
from meshnodes import open_nodes
import meshd.experts as mx
from experts import ddm, hdee
from meshd import Config
from meshd.rpc import DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted, RpcError
from meshd.services.experts import ensembles
from meshd.services.experts.ensembles import STRAGGLER_MIN
from meshd.services.experts.remote import COALESCE_DEPTH


class Counting(torch.nn.Module):
    """A linear layer that counts its forward calls and the rows of each (and can be
    held at a gate, or broken)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(4, 3)
        self.forwards, self.broken = 0, False
        self.rows: list[int] = []
        self.started = threading.Event()
        self.gate = threading.Event()  # cleared: a forward waits (up to 10 s) until it is set
        self.gate.set()

    def forward(self, x):
        self.forwards += 1
        self.rows.append(len(x))
        self.started.set()
        self.gate.wait(10)
        if self.broken:
            raise RuntimeError("the module broke")
        return self.linear(x)


class TinyLM(torch.nn.Module):
    def __init__(self, seed: int, vocab: int = 11):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.head = torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids).cumsum(dim=1)))


async def _serve_two_lms(nodes) -> dict:
    """Experts "code" and "legal" (TinyLMs) served on the first two nodes; {id: module}."""
    lms = {"code": TinyLM(1), "legal": TinyLM(2)}
    for node, (name, lm) in zip(nodes, lms.items()):
        await mx.serve(node, lm, expert_id=name, kind="lm", domain=name)
    return lms


async def test_a_remote_expert_answers_as_the_module_does_and_batches_concurrent_calls(tmp_path):
    async with AsyncExitStack() as stack:
        a, b = await open_nodes(stack, tmp_path, 2)
        module = Counting()
        await mx.serve(a, module, expert_id="lin", max_batch=8, max_wait_ms=200)
        expert = mx.RemoteExpert(b, "lin", coalesce=False)  # a request per call: the server batches them
        x = torch.randn(16, 4)
        answers = [None] * 16
        async with trio.open_nursery() as nursery:
            for i in range(16):
                async def one(i=i):
                    answers[i] = await expert.call(x[i:i + 1])
                nursery.start_soon(one)
        got = torch.cat([ans.outputs[0] for ans in answers])
        assert torch.allclose(got, module.linear(x).detach(), atol=1e-6)
        assert module.forwards < 16 and max(ans.batch for ans in answers) > 1  # calls shared batches
        served = a.service("experts").served["lin"]
        assert served.batches == module.forwards and served.rows == 16 and served.calls == 16


async def _call_all(expert, xs: list) -> dict:
    """``expert.call(x)`` for every x of ``xs``, all at once: {i: its Answer, or its ExpertUnavailable}."""
    outcomes = {}

    async def one(i: int) -> None:
        try:
            outcomes[i] = await expert.call(xs[i])
        except mx.ExpertUnavailable as exc:
            outcomes[i] = exc

    async with trio.open_nursery() as nursery:
        for i in range(len(xs)):
            nursery.start_soon(one, i)
    return outcomes


async def _coalescing(stack, tmp_path, max_batch: int) -> tuple:
    """Node a serving ``lin`` (a Counting) with ``max_batch``, and node b's RemoteExpert of it
    after one call (so it knows the server and its max_batch): (module, served, expert)."""
    a, b = await open_nodes(stack, tmp_path, 2)
    module = Counting()
    served = await mx.serve(a, module, expert_id="lin", max_batch=max_batch, max_wait_ms=0)
    expert = mx.RemoteExpert(b, "lin")
    await expert.call(torch.randn(1, 4))
    return module, served, expert


async def test_concurrent_calls_from_one_node_share_requests_and_each_caller_gets_its_own_rows(tmp_path):
    async with AsyncExitStack() as stack:
        module, served, expert = await _coalescing(stack, tmp_path, max_batch=64)
        xs = [torch.randn(1 + i % 3, 4) for i in range(24)]  # 1 to 3 rows a call
        answers = await _call_all(expert, xs)
        for i, x in enumerate(xs):
            assert torch.allclose(answers[i].outputs[0], module.linear(x).detach(), atol=1e-6)
        assert served.calls == 1 + 1 and served.rows == 1 + sum(len(x) for x in xs)  # made at once: one request

        module.gate.clear()  # the module holds the first request
        xs, answers = torch.randn(COALESCE_DEPTH + 1, 8, 4), {}

        async def one(k: int, i: int) -> None:
            answers[k, i] = await expert.call(xs[k, i:i + 1])

        async with trio.open_nursery() as nursery:
            for k in range(COALESCE_DEPTH + 1):  # 8 calls at a time: a request each while the
                for i in range(8):  # depth allows, then 8 that wait for one to come back
                    nursery.start_soon(one, k, i)
                await trio.testing.wait_all_tasks_blocked()
            module.gate.set()
        for (k, i), answer in answers.items():
            assert torch.allclose(answer.outputs[0], module.linear(xs[k, i:i + 1]).detach(), atol=1e-6)
        assert len(answers) == xs.shape[0] * 8 and served.calls == 2 + COALESCE_DEPTH + 1


async def test_a_coalesced_request_carries_no_more_rows_than_the_servers_max_batch(tmp_path):
    async with AsyncExitStack() as stack:
        module, served, expert = await _coalescing(stack, tmp_path, max_batch=4)
        xs = list(torch.randn(16, 1, 4))
        answers = await _call_all(expert, xs)
        for i, x in enumerate(xs):
            assert torch.allclose(answers[i].outputs[0], module.linear(x).detach(), atol=1e-6)
        assert max(module.rows) <= 4  # a larger request would have run as a batch of its own
        assert served.calls == 1 + 16 // 4


async def test_an_error_in_a_coalesced_request_reaches_every_caller_in_it(tmp_path):
    async with AsyncExitStack() as stack:
        module, served, expert = await _coalescing(stack, tmp_path, max_batch=64)
        module.broken = True
        outcomes = await _call_all(expert, list(torch.randn(8, 1, 4)))
        assert len(outcomes) == 8 and served.failed == 1  # one request failed, and every caller heard why
        assert all(isinstance(o, mx.ExpertUnavailable) and "the module broke" in str(o) for o in outcomes.values())


async def test_a_timeout_reaches_every_caller_whether_its_call_was_sent_or_waited(tmp_path):
    async with AsyncExitStack() as stack:
        module, served, expert = await _coalescing(stack, tmp_path, max_batch=64)
        expert.timeout = 0.5
        module.gate.clear()  # the module holds the first request: nothing answers
        outcomes = {}

        async def one(k: int, i: int) -> None:
            try:
                await expert.call(torch.randn(1, 4))
            except mx.ExpertUnavailable as exc:
                outcomes[k, i] = str(exc)

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for k in range(COALESCE_DEPTH + 1):  # requests in flight, then calls that wait for one
                    for i in range(4):
                        nursery.start_soon(one, k, i)
                    await trio.testing.wait_all_tasks_blocked()
        module.gate.set()
        assert len(outcomes) == 4 * (COALESCE_DEPTH + 1)  # every caller heard, within the 5 s
        # those sent timed out; those that waited were sent then, to a server backing off for that
        assert all("no answer within 0.5 s" in o for (k, _), o in outcomes.items() if k < COALESCE_DEPTH)


async def test_a_caller_out_of_time_hears_so_when_its_request_failed_in_the_same_moment(tmp_path, monkeypatch):
    """The request's own deadline is as long as the caller's and starts a moment later: in a
    process woken late both have passed, and trio runs the two woken tasks in either order
    (found in a full suite: a caller heard the request's error, not its timeout)."""
    async with AsyncExitStack() as stack:
        _, _, expert = await _coalescing(stack, tmp_path, max_batch=64)
        expert.timeout = 0.05

        async def failing_at_its_deadline(inputs, op):
            await trio.sleep(expert.timeout)
            raise mx.ExpertUnavailable("the request's own deadline")

        monkeypatch.setattr(expert, "_ask", failing_at_its_deadline)
        for _ in range(20):
            with pytest.raises(mx.ExpertUnavailable, match="no answer within 0.05 s"):
                await expert.call(torch.randn(1, 4))


async def test_a_caller_that_leaves_a_coalesced_request_costs_the_others_nothing(tmp_path):
    async with AsyncExitStack() as stack:
        module, served, expert = await _coalescing(stack, tmp_path, max_batch=3)
        module.gate.clear()
        xs, answers, scopes = torch.randn(4, 4), {}, [trio.CancelScope() for _ in range(4)]

        async def one(i: int) -> None:
            with scopes[i]:
                answers[i] = await expert.call(xs[i:i + 1])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0)  # the module holds it
            await trio.testing.wait_all_tasks_blocked()
            for i in (1, 2, 3):  # one request of 3 rows
                nursery.start_soon(one, i)
            await trio.testing.wait_all_tasks_blocked()
            scopes[2].cancel()  # one of them leaves; the others still wait for it
            await trio.testing.wait_all_tasks_blocked()
            module.gate.set()
        assert sorted(answers) == [0, 1, 3]
        for i, answer in answers.items():
            assert torch.allclose(answer.outputs[0], module.linear(xs[i:i + 1]).detach(), atol=1e-6)
        assert answers[1].batch == 3 and served.rows == 1 + 4  # the request went on, with the row of 2


async def test_bad_calls_get_clear_errors_and_the_expert_serves_on(tmp_path):
    async with AsyncExitStack() as stack:
        a, b = await open_nodes(stack, tmp_path, 2)
        module = Counting()
        await mx.serve(a, module, expert_id="lin", max_wait_ms=0)
        good = {"dtype": "float32", "shape": [1, 4], "data": bytes(16)}
        bad = [({"expert": "lin", "op": "forward", "inputs": [{**good, "data": bytes(15)}]}, InvalidArgument, "bytes"),
               ({"expert": "lin", "op": "forward", "inputs": [{**good, "dtype": "complex"}]}, InvalidArgument, "dtype"),
               ({"expert": "lin", "op": "forward", "inputs": [good] * 17}, InvalidArgument, "1 to 16"),
               ({"expert": "lin", "op": "score", "inputs": [good]}, InvalidArgument, "forward"),
               ({"expert": "nope", "op": "forward", "inputs": [good]}, NotFound, "not served")]
        for arg, error, words in bad:
            with pytest.raises(error, match=words):
                await b.rpc.call(a.peer_id, "experts.call", arg)
        module.broken = True
        with pytest.raises(RpcError, match="the module broke"):
            await b.rpc.call(a.peer_id, "experts.call", {"expert": "lin", "op": "forward", "inputs": [good]})
        module.broken = False
        reply = await b.rpc.call(a.peer_id, "experts.call", {"expert": "lin", "op": "forward", "inputs": [good]})
        assert reply["batch"] == 1 and reply["outputs"][0]["shape"] == [1, 3]


async def slow_expert(stack: AsyncExitStack, tmp_path, **experts) -> tuple:
    """Nodes a and b, a serving ``slow`` (a Counting held at its gate until the test opens it,
    one row a batch) with the [experts] keys ``experts``: (a, b, the module, its Served)."""
    config = Config()
    for key, value in experts.items():
        setattr(config.experts, key, value)
    a, b = await open_nodes(stack, tmp_path, 2, config)
    module = Counting()
    module.gate.clear()
    stack.callback(module.gate.set)  # its worker thread ends before the nodes close
    return a, b, module, await mx.serve(a, module, expert_id="slow", max_batch=1, max_wait_ms=0)


async def test_a_full_queue_refuses_new_calls(tmp_path):
    async with AsyncExitStack() as stack:
        a, b, module, _ = await slow_expert(stack, tmp_path, max_queue=2)
        x = torch.randn(1, 4)
        outcomes, refused = [], trio.Event()

        async def one():
            try:
                await b.service("experts").call(a.peer_id, "slow", "forward", [x], timeout=10)
                outcomes.append("ok")
            except ResourceExhausted:
                outcomes.append("busy")
                refused.set()

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
                await trio.sleep(0)
            with trio.fail_after(10):
                await refused.wait()  # the first call is held in the module, the second queued
            module.gate.set()
        assert sorted(outcomes) == ["busy", "ok", "ok"]
        assert a.service("experts").served["slow"].refused == 1


async def test_a_slow_server_is_hedged_and_a_gone_one_failed_over(tmp_path):
    async with AsyncExitStack() as stack:
        a, b, c = await open_nodes(stack, tmp_path, 3)
        slow, fast = Counting(), Counting()
        slow.gate.clear()  # it never answers while the test runs
        stack.callback(slow.gate.set)
        await mx.serve(a, slow, expert_id="lin", max_wait_ms=0)
        await mx.serve(b, fast, expert_id="lin", max_wait_ms=0)
        expert = mx.RemoteExpert(c, "lin", timeout=10)
        assert {p.key for p in await expert.servers()} == {a.peer_id.key, b.peer_id.key}
        expert.stats.observe(a.peer_id, 0.001, True, trio.current_time())  # a looks fastest: asked first
        expert.stats.observe(b.peer_id, 0.050, True, trio.current_time())
        x = torch.randn(2, 4)
        with trio.fail_after(5):
            answer = await expert.call(x)
        assert answer.peer == b.peer_id and answer.asked == 2
        assert torch.allclose(answer.outputs[0], fast.linear(x).detach())
        a.service("experts").unserve("lin")  # gone: a answers NOT_FOUND now
        expert.stats.observe(a.peer_id, 0.001, True, trio.current_time())
        expert.hedge = False
        answer = await expert.call(x)
        assert answer.peer == b.peer_id and answer.asked == 2


async def test_hdee_over_the_mesh_is_the_mixture_in_one_process_and_drops_a_dead_expert(tmp_path):
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 3)
        lms = await _serve_two_lms(nodes)
        ids = torch.tensor([1, 5, 2, 7, 7, 3, 9, 0, 4])
        with torch.no_grad():
            logp = torch.stack([torch.log_softmax(lm(ids[None]), -1)[0, :-1].gather(-1, ids[1:, None])[:, 0]
                                for lm in lms.values()])
        prior = {"code": 0.25, "legal": 0.75}
        ens = mx.HDEEEnsemble(nodes[2], list(lms), prior=prior)
        scored = await ens.score(ids)
        want, _ = hdee.posterior_mixture(logp.double(), torch.tensor([0.25, 0.75]).log().double())
        assert scored.answered == ["code", "legal"] and not scored.dropped
        assert (scored.logp.double() - want).abs().max() <= 1e-6
        next_logp, _ = await ens.next_token_logprobs(ids)
        assert next_logp.shape == (11,) and abs(float(next_logp.exp().sum()) - 1) < 1e-5
        nodes[1].service("experts").unserve("legal")
        scored = await ens.score(ids)
        assert scored.answered == ["code"] and "legal" in scored.dropped
        assert torch.allclose(scored.logp, logp[0], atol=1e-6) and ens.weights == {"code": 1.0}


class Flow(torch.nn.Module):
    """v(x, t) pulling toward its own centre (an exact, checkable velocity field)."""

    def __init__(self, centre):
        super().__init__()
        self.centre = torch.tensor(centre)

    def forward(self, x, t):
        return (self.centre - x) / (1.0 - t[:, None] + 0.05)


class Router(torch.nn.Module):
    """Logits: minus the distance to each expert's centre."""

    def __init__(self, centres):
        super().__init__()
        self.centres = torch.tensor(centres)

    def forward(self, x, t):
        return -torch.cdist(x, self.centres)


@pytest.mark.parametrize("mode", ["full", "topk", "top1", "uniform"])
async def test_ddm_over_the_mesh_is_the_local_sampler_and_calls_only_whom_it_routes_to(tmp_path, mode,
                                                                                       monkeypatch):
    # Routing, not stragglers: a stall of this test process (a full collection of pytest's heap) once
    # dropped c0 as slow, when c1's in-process answer still started the straggler clock.
    monkeypatch.setattr(ensembles, "STRAGGLER_MIN", 30.0)
    centres = [[2.0, 0.0], [-2.0, 0.0], [0.0, 2.0]]
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 2)
        flows = [Flow(c) for c in centres]
        for i, flow in enumerate(flows):
            await mx.serve(nodes[i % 2], flow, expert_id=f"c{i}", kind="flow")
        await mx.serve(nodes[0], Router(centres), expert_id="router", kind="router")
        ens = mx.DDMEnsemble(nodes[1], [f"c{i}" for i in range(3)], "router" if mode != "uniform" else None,
                             mode=mode, top_k=2)
        out = await ens.sample(32, 2, steps=8, seed=3)
        x = torch.randn(32, 2, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            for t in ddm.euler_times(8):
                times = torch.full((32,), t)
                w = ddm.route(Router(centres)(x, times).double() if mode != "uniform" else torch.zeros(32, 3),
                              "full" if mode == "uniform" else mode, 2)
                v, _ = ddm.combine(w, {i: f(x, times) for i, f in enumerate(flows)})
                x = ddm.euler_step(x, v, 1 / 8)
        assert torch.allclose(out.x, x, atol=1e-5) and not out.dropped
        per_step = {"full": 3, "topk": 2, "top1": 1, "uniform": 3}[mode]
        assert sum(out.rows.values()) == 8 * 32 * per_step  # each sample went only to the experts it weighs


def _slow_to_find(node, expert_id: str, seconds: float) -> None:
    """Make ``node``'s lookups of ``expert_id``'s servers take ``seconds`` longer."""
    service = node.service("experts")
    find = service.servers

    async def slow(wanted, count=20):
        if wanted == expert_id:
            await trio.sleep(seconds)
        return await find(wanted, count)

    service.servers = slow


async def test_an_expert_whose_servers_take_long_to_find_is_not_dropped_as_slow(tmp_path):
    """The straggler clock starts once every expert's servers are known: an expert the
    first step must find through a slow DHT lookup, while the local one answers at once,
    is not dropped (it was, on a loaded CI machine)."""
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 2)
        await mx.serve(nodes[0], Flow([2.0, 0.0]), expert_id="c0", kind="flow")
        await mx.serve(nodes[1], Flow([-2.0, 0.0]), expert_id="c1", kind="flow")
        _slow_to_find(nodes[1], "c0", 1.2 * STRAGGLER_MIN)
        out = await mx.DDMEnsemble(nodes[1], ["c0", "c1"], mode="uniform").sample(8, 2, steps=2)
        assert not out.dropped and out.rows == {"c0": 16, "c1": 16}


async def test_an_expert_whose_lookup_hangs_holds_a_step_for_the_straggler_waits_only(tmp_path):
    """An expert nobody is found for is looked for again each step, for up to FIND_WAIT (here
    a lookup that hangs far longer): the step waits STRAGGLER_MIN for the lookups, then
    STRAGGLER_MIN for the answers, and goes on without it."""
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 2)
        await mx.serve(nodes[0], Flow([2.0, 0.0]), expert_id="c0", kind="flow")
        _slow_to_find(nodes[1], "ghost", 10 * STRAGGLER_MIN)
        started = trio.current_time()
        out = await mx.DDMEnsemble(nodes[1], ["c0", "ghost"], mode="uniform").sample(8, 2, steps=1)
        assert trio.current_time() - started < 5 * STRAGGLER_MIN
        assert set(out.dropped) == {"ghost"} and out.rows == {"c0": 8}


async def test_ddm_sampling_goes_on_without_an_expert_that_dies(tmp_path):
    centres = [[2.0, 0.0], [-2.0, 0.0]]
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 3)
        await mx.serve(nodes[0], Flow(centres[0]), expert_id="c0", kind="flow")
        await mx.serve(nodes[1], Flow(centres[1]), expert_id="c1", kind="flow")
        await mx.serve(nodes[0], Router(centres), expert_id="router", kind="router")
        ens = mx.DDMEnsemble(nodes[2], ["c0", "c1"], "router", mode="top1")
        sampled = mx.Sampled(torch.zeros(0), {}, {})
        x = torch.randn(16, 2, generator=torch.Generator().manual_seed(0))
        await ens.velocity(x, 0.0, sampled)
        nodes[1].service("experts").unserve("c1")
        v = await ens.velocity(x, 0.5, sampled)
        assert "c1" in sampled.dropped and torch.isfinite(v).all()
        want = Flow(centres[0])(x, torch.full((16,), 0.5))
        assert torch.allclose(v, want, atol=1e-6)  # every sample re-routed to c0


async def test_a_published_expert_is_replicated_by_shard_sync_and_served_by_both(tmp_path):
    async with AsyncExitStack() as stack:
        a, b, c = await open_nodes(stack, tmp_path, 3)
        original, copy = Counting(seed=1), Counting(seed=2)
        assert not torch.equal(original.linear.weight, copy.linear.weight)
        await mx.publish(a, original, expert_id="lin", domain="test")
        await mx.replicate(b, copy, expert_id="lin")
        assert torch.equal(original.linear.weight, copy.linear.weight)  # the weights came by shard sync
        info = await b.service("experts").info(b.peer_id, "lin")
        assert info["domain"] == "test" and len(info["model"]) == 64
        with trio.fail_after(10):
            while len(await mx.RemoteExpert(c, "lin").servers()) < 2:  # a fresh look each time
                await trio.sleep(0.1)
        x = torch.randn(3, 4)
        for server in (a, b):
            outputs, _ = await c.service("experts").call(server.peer_id, "lin", "forward", [x])
            assert torch.allclose(outputs[0], original.linear(x).detach(), atol=1e-6)
        await mx.serve(a, Counting(), expert_id="plain")
        with pytest.raises(ValueError, match="no published model"):
            await mx.replicate(c, Counting(), expert_id="plain")


async def test_an_expert_trained_and_published_in_one_call_answers_with_its_trained_weights(tmp_path):
    async with AsyncExitStack() as stack:
        a, b = await open_nodes(stack, tmp_path, 2)
        module = Counting(seed=1)
        target = torch.nn.Linear(4, module.linear.out_features)
        x = torch.randn(64, 4)
        y = target(x).detach()

        def loss(gen):
            rows = torch.randint(len(x), (16,), generator=gen)
            return torch.nn.functional.mse_loss(module.linear(x[rows]), y[rows])

        before = torch.nn.functional.mse_loss(module.linear(x), y).item()
        _, losses = await mx.train_and_publish(a, module, loss, 200, expert_id="fit", lr=0.05, domain="test")
        assert len(losses) == 200 and losses[-1] < before / 10
        copy = Counting(seed=2)
        await mx.replicate(b, copy, expert_id="fit")  # the trained weights, by shard sync
        outputs, _ = await b.service("experts").call(b.peer_id, "fit", "forward", [x])
        assert torch.allclose(outputs[0], module.linear(x).detach(), atol=1e-6)


async def test_served_experts_are_listed_in_a_shared_registry_document(tmp_path):
    async with AsyncExitStack() as stack:
        [a] = await open_nodes(stack, tmp_path / "a", 1)
        shared = Config()
        shared.experts.registry = f"{a.peer_id}/experts"  # b writes to a's registry
        [b] = await open_nodes(stack, tmp_path / "b", 1, shared)
        await b.connect(a.address)
        await mx.serve(a, Counting(), expert_id="lin", domain="test")
        listing = await a.service("experts").registry()
        assert listing["lin"]["about"]["domain"] == "test" and list(listing["lin"]["servers"]) == [str(a.peer_id)]
        experts_a = a.service("experts")
        replica = await experts_a._registry()
        a.service("crdt").write(replica, lambda tx: tx.grant(b.peer_id.key, "writer"))
        await mx.serve(b, Counting(), expert_id="flow", kind="flow")
        control = a.service("experts").control_methods()
        with trio.fail_after(10):
            while True:
                rows = {r["expert"]: r for r in (await control["experts.ls"]({"all": True}, None))["experts"]}
                if "flow" in rows:
                    break
                await trio.sleep(0.1)
        assert rows["flow"]["kind"] == "flow" and rows["flow"]["servers"] == [str(b.peer_id)]
        a.service("experts").unserve("lin")
        with trio.fail_after(5):
            while (await experts_a.registry())["lin"].get("servers"):
                await trio.sleep(0.05)


async def test_registry_entries_carry_load_and_a_dead_server_is_listed_as_stale(tmp_path):
    quick = Config()
    quick.experts.heartbeat = 0.2
    async with AsyncExitStack() as stack:
        [a] = await open_nodes(stack, tmp_path / "a", 1, quick)
        quick.experts.registry = f"{a.peer_id}/experts"
        replica = await a.service("experts")._registry()
        async with AsyncExitStack() as b_stack:
            [b] = await open_nodes(b_stack, tmp_path / "b", 1, quick)
            await b.connect(a.address)
            a.service("crdt").write(replica, lambda tx: tx.grant(b.peer_id.key, "writer"))
            await mx.serve(b, Counting(), expert_id="lin")
            for _ in range(3):
                await b.service("experts").call(b.peer_id, "lin", "forward", [torch.randn(2, 4)])
            ls = a.service("experts").control_methods()["experts.ls"]
            with trio.fail_after(10):  # a heartbeat brings the calls into a's replica
                while not (rows := (await ls({"all": True}, None))["experts"]) or rows[0]["load"]["calls"] < 3:
                    await trio.sleep(0.05)
            assert rows[0]["servers"] == [str(b.peer_id)] and rows[0]["stale"] == []
        # b is gone without unserving: after 3 missed heartbeats it is stale, not a server
        with trio.fail_after(10):
            while not (row := (await ls({"all": True}, None))["experts"][0])["stale"]:
                await trio.sleep(0.05)
        assert row["servers"] == [] and row["stale"] == [str(b.peer_id)]


async def test_an_hdee_prior_estimated_on_held_out_text_weighs_the_expert_that_fits_it(tmp_path):
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 3)
        good, poor = TinyLM(1), TinyLM(2)
        with torch.no_grad():  # "good" puts most of its mass on token 3 whatever came before
            good.head.bias.zero_()
            good.head.bias[3] = 8.0
        await mx.serve(nodes[0], good, expert_id="good", kind="lm")
        await mx.serve(nodes[1], poor, expert_id="poor", kind="lm")
        ens = mx.HDEEEnsemble(nodes[2], ["good", "poor"])
        held_out = [torch.tensor([3] * 12), torch.tensor([1] + [3] * 9)]
        prior = await ens.estimate_prior(held_out)
        assert set(prior) == {"good", "poor"} and abs(sum(prior.values()) - 1) < 1e-9
        assert prior["good"] > 0.99 and ens.prior == prior
        scored = await ens.score(torch.tensor([3, 3]))
        assert scored.log_weights[0, 0].exp() > 0.99  # the first token already leans on the prior


class SlowLM(TinyLM):
    """Answers only once ``release`` is set (in the serving worker thread)."""

    def __init__(self, seed: int):
        super().__init__(seed)
        self.release = threading.Event()

    def forward(self, ids):
        self.release.wait(30)
        return super().forward(ids)


async def test_an_expert_far_slower_than_the_others_is_dropped_from_the_mixture(tmp_path):
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 3)
        await mx.serve(nodes[0], TinyLM(1), expert_id="fast", kind="lm")
        slow = SlowLM(2)
        stack.callback(slow.release.set)  # its worker thread ends before the nodes close
        await mx.serve(nodes[1], slow, expert_id="slow", kind="lm")
        ens = mx.HDEEEnsemble(nodes[2], ["fast", "slow"])
        await mx.RemoteExpert(nodes[2], "slow").servers()  # found, so the wait below is the call's
        started = trio.current_time()
        scored = await ens.score(torch.tensor([1, 2, 3, 4]))
        assert trio.current_time() - started < 2.5  # not until the slow one answers, nor the 30 s call timeout
        assert scored.answered == ["fast"] and "dropped as slow" in scored.dropped["slow"]
        assert ens.experts["slow"].stats.failures(nodes[1].peer_id) == 1  # backed off: the next step does not wait


class UnhurriedLM(TinyLM):
    """Takes ``seconds`` of compute per forward (in the serving worker thread)."""

    def __init__(self, seed: int, seconds: float):
        super().__init__(seed)
        self.seconds = seconds

    def forward(self, ids):
        time.sleep(self.seconds)
        return super().forward(ids)


async def test_an_answer_from_an_expert_served_here_does_not_start_the_straggler_clock(tmp_path, monkeypatch):
    """An expert this node serves answers in-process at once; the remote one, slower than
    STRAGGLER_MIN (and never slower than usual: nothing to compare it with), is waited for."""
    monkeypatch.setattr(ensembles, "STRAGGLER_MIN", 0.1)
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 2)
        await mx.serve(nodes[0], UnhurriedLM(2, 0.5), expert_id="remote", kind="lm")
        await mx.serve(nodes[1], TinyLM(1), expert_id="here", kind="lm")
        ens = mx.HDEEEnsemble(nodes[1], ["here", "remote"])
        await ens.experts["remote"].servers()
        assert ens.experts["here"].served_here() and not ens.experts["remote"].served_here()
        scored = await ens.score(torch.tensor([1, 2, 3, 4]))
        assert sorted(scored.answered) == ["here", "remote"] and not scored.dropped


async def test_a_call_the_expert_cannot_get_to_in_time_is_deadline_exceeded_and_shapes_leave_no_state(tmp_path):
    async with AsyncExitStack() as stack:
        a, b, module, served = await slow_expert(stack, tmp_path, call_timeout=0.5)
        outcomes, refused = [], trio.Event()

        async def one(rows: int):
            try:
                await b.service("experts").call(a.peer_id, "slow", "forward", [torch.randn(rows, 4)], timeout=5)
                outcomes.append("ok")
            except DeadlineExceeded as exc:
                outcomes.append(str(exc))
                refused.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 1)
            await trio.to_thread.run_sync(module.started.wait)  # the first call is in the module
            nursery.start_soon(one, 2)  # waits behind it past the server's call_timeout
            with trio.fail_after(5):
                await refused.wait()
            module.gate.set()
        assert any("did not get to this call" in o for o in outcomes)
        with trio.fail_after(5):
            while served._batchers:  # the per-shape batchers go once empty
                await trio.sleep(0.05)


async def test_ls_says_each_servers_health_and_the_latency_this_node_measured(tmp_path):
    async with AsyncExitStack() as stack:
        a, b, c = await open_nodes(stack, tmp_path, 3)
        module = Counting()
        await mx.serve(a, module, expert_id="lin")
        [mine] = (await a.service("experts").control_methods()["experts.ls"]({}, None))["experts"]
        assert mine["health"] == "ok" and mine["latency_ms"] is None  # nobody here called it yet
        expert = mx.RemoteExpert(b, "lin")
        for _ in range(3):
            await expert(torch.randn(1, 4))
        ls_b, ls_c = (n.service("experts").control_methods()["experts.ls"] for n in (b, c))
        [row] = (await ls_b({"find": ["lin"]}, None))["experts"]
        [peer] = row["peers"]
        ewma_ms = 1000 * b.service("experts").measured["lin"].ewma(str(a.peer_id))
        assert peer == {"peer": str(a.peer_id), "health": "ok", "latency_ms": round(ewma_ms, 3),
                        "latency_from": "calls"}
        assert row["health"] == "ok" and row["latency_ms"] == peer["latency_ms"] and row["params"] == 15
        [row] = (await ls_c({"find": ["lin"]}, None))["experts"]  # c never called it: an info round trip
        assert row["health"] == "ok" and row["peers"][0]["latency_from"] == "ping" and row["latency_ms"] > 0
        module.broken = True
        with pytest.raises(mx.ExpertUnavailable):
            await expert(torch.randn(1, 4))
        [row] = (await ls_b({"find": ["lin"]}, None))["experts"]
        # backed off for 1 s, then failing until it answers again (a slow listing may see either)
        assert row["health"] in ("backed-off", "failing") and row["peers"][0]["failures"] == 1
        assert row["latency_ms"] is None


async def test_next_token_logprobs_says_who_answered_and_still_unpacks_as_a_pair(tmp_path):
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 3)
        lms = await _serve_two_lms(nodes)
        ens = mx.HDEEEnsemble(nodes[2], list(lms), prior="uniform")
        ids = torch.tensor([1, 5, 2, 7, 7, 3])
        logp = await ens.next_token_logprobs(ids)  # as the snippet writes it
        assert isinstance(logp, mx.NextToken) and logp.answered == ["code", "legal"] and logp.dropped == {}
        assert logp.logp.shape == (11,) and set(logp.weights) == {"code", "legal"}
        with torch.no_grad():  # the mixture of the experts' next-token distributions, by posterior weight
            last = [torch.log_softmax(lm(ids[None]), -1)[0, -1].double() for lm in lms.values()]
        want = torch.logsumexp(torch.stack([last[i] + torch.tensor(logp.weights[e]).double().log()
                                            for i, e in enumerate(lms)]), 0)
        assert torch.allclose(logp.logp.double(), want, atol=1e-5)
        nodes[1].service("experts").unserve("legal")
        mixed, scored = await ens.next_token_logprobs(ids)  # the earlier (logp, scored) pair
        assert scored.answered == ["code"] and "legal" in scored.dropped
        assert torch.allclose(mixed.double(), last[0], atol=1e-5)


async def test_ddm_top_k_1_routes_top1_without_a_mode_and_sample_finds_dim_in_the_experts_info(tmp_path,
                                                                                               monkeypatch):
    # Routing, not stragglers: on a loaded machine the second sampling once dropped c0 as slow
    # after 1 s, and then differed from the first.
    monkeypatch.setattr(ensembles, "STRAGGLER_MIN", 30.0)
    centres = [[2.0, 0.0], [-2.0, 0.0], [0.0, 2.0]]
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 2)
        flows = [Flow(c) for c in centres]
        for i, flow in enumerate(flows):
            await mx.serve(nodes[i % 2], flow, expert_id=f"c{i}", kind="flow", dim=2)
        router = Router(centres)
        router.dim = 2  # said by the module itself
        await mx.serve(nodes[0], router, expert_id="ddm-router", kind="router")
        ids = [f"c{i}" for i in range(3)]
        ddm_ens = mx.DDMEnsemble(nodes[1], experts=ids, router="ddm-router", top_k=1)  # the snippet
        assert ddm_ens.mode == "top1"
        x = await ddm_ens.sample(n=16, steps=4)
        want = await mx.DDMEnsemble(nodes[1], ids, "ddm-router", mode="top1").sample(16, 2, steps=4)
        assert x.x.shape == (16, 2) and torch.equal(x.x, want.x) and sum(x.rows.values()) == 4 * 16
        assert mx.DDMEnsemble(nodes[1], ids, "ddm-router", top_k=2).mode == "topk"
        assert mx.DDMEnsemble(nodes[1], ids, "ddm-router").mode == "full"
        assert mx.DDMEnsemble(nodes[1], ids).mode == "uniform"
        with pytest.raises(ValueError, match="top_k"):
            mx.DDMEnsemble(nodes[1], ids, "ddm-router", top_k=0)
        await mx.serve(nodes[0], Flow([0.0, 0.0]), expert_id="nodim", kind="flow")
        with pytest.raises(ValueError, match="dim"):
            await mx.DDMEnsemble(nodes[1], ["nodim"]).sample(n=4, steps=2)


async def test_a_server_row_another_writer_forged_is_not_listed(tmp_path):
    async with AsyncExitStack() as stack:
        [a] = await open_nodes(stack, tmp_path / "a", 1)
        shared = Config()
        shared.experts.registry = f"{a.peer_id}/experts"
        [b] = await open_nodes(stack, tmp_path / "b", 1, shared)
        await b.connect(a.address)
        experts_a, crdt_b = a.service("experts"), b.service("crdt")
        a.service("crdt").write(await experts_a._registry(), lambda tx: tx.grant(b.peer_id.key, "writer"))
        replica_b = await b.service("experts")._registry()
        await crdt_b.sync(replica_b, a.peer_id)  # b has the grant
        await mx.serve(b, Counting(), expert_id="flow")  # b's own row: it counts
        row = {"since": time.time(), "seen": time.time(), "load": {"queued": 0, "calls": 0}}
        crdt_b.write(replica_b, lambda tx: [tx.set(["ghost", "about"], {"kind": "module"}),
                                            tx.set(["ghost", "servers", str(a.peer_id)], row)])  # forged: a's id
        await crdt_b.sync(replica_b, a.peer_id)  # a has both rows
        listing = await experts_a.registry()
        assert listing["ghost"]["servers"] == {} and listing["ghost"]["rejected"] == [str(a.peer_id)]
        ls = experts_a.control_methods()["experts.ls"]
        rows = {r["expert"]: r for r in (await ls({"all": True}, None))["experts"]}
        assert rows["flow"]["servers"] == [str(b.peer_id)] and "rejected" not in rows["flow"]
        assert rows["ghost"]["servers"] == [] and rows["ghost"]["stale"] == [] and rows["ghost"]["rejected"] == 1
        assert rows["ghost"]["health"] == "none"


async def test_a_node_the_registry_owner_did_not_let_write_still_serves_and_says_so_once(tmp_path, caplog):
    async with AsyncExitStack() as stack:
        [a] = await open_nodes(stack, tmp_path / "a", 1)
        await a.service("experts")._registry()  # a's registry exists, and b is not granted writer
        shared = Config()
        shared.experts.registry = f"{a.peer_id}/experts"
        [b] = await open_nodes(stack, tmp_path / "b", 1, shared)
        await b.connect(a.address)
        module = Counting()
        with caplog.at_level(logging.WARNING, logger="meshd.experts"):
            await mx.serve(b, module, expert_id="lin")
            await b.service("experts")._write_registry(lambda tx: tx.set(["lin", "about"], {}))  # refused again
        warnings = [r.getMessage() for r in caplog.records
                    if r.name == "meshd.experts" and r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "not written" in warnings[0] and "may not write" in warnings[0]
        x = torch.randn(2, 4)
        outputs, _ = await a.service("experts").call(b.peer_id, "lin", "forward", [x])
        assert torch.allclose(outputs[0], module.linear(x).detach(), atol=1e-6)
        assert "lin" not in await a.service("experts").registry()


@pytest.mark.parametrize("mode, called", [("full", ["c0", "c1", "c2"]), ("topk", ["c0", "c2"]), ("top1", ["c0"])])
async def test_ddm_calls_only_the_experts_some_sample_is_routed_to_at_that_step(tmp_path, mode, called):
    centres = [[2.0, 0.0], [-2.0, 0.0], [0.5, 0.5]]
    async with AsyncExitStack() as stack:
        nodes = await open_nodes(stack, tmp_path, 2)
        for i, centre in enumerate(centres):
            await mx.serve(nodes[0], Flow(centre), expert_id=f"c{i}", kind="flow")
        await mx.serve(nodes[0], Router(centres), expert_id="router", kind="router")
        ens = mx.DDMEnsemble(nodes[1], [f"c{i}" for i in range(3)], "router", mode=mode, top_k=2)
        sampled = mx.Sampled(torch.zeros(0), {}, {})
        x = torch.tensor([2.0, 0.0]) + 0.1 * torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
        await ens.velocity(x, 0.5, sampled)  # every sample nearest c0, then c2: c1 is never in a top 2
        assert sorted(sampled.calls) == called and set(sampled.calls.values()) == {1}
        assert sampled.rows == {name: 8 for name in called}
