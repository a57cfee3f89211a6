"""The figures of the metrics service, with no socket: histograms, the call tables the
RPC layer fills, snapshots, their Prometheus form, the [metrics] address rule, and
what ``meshctl top`` computes and shows."""

from __future__ import annotations

import io

import pytest
import trio
from fakehost import FakeHost
from memstream import memory_call_stream_pair
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cli.commands.top import rates, render
from meshd.config import ConfigError
from meshd.histogram import Histogram, cumulative
from meshd.identity import Identity
from meshd.rpc import InvalidArgument, RpcServer
from meshd.rpc.client import unary_call
from meshd.rpc.errors import DeadlineExceeded
from meshd.rpc.peer import PeerRpc, RpcConfig
from meshd.rpc.stats import OTHER, CallStats, CallTable
from meshd.services.metrics import Metrics, MetricsSection
from meshd.services.metrics.families import HELP, families
from meshd.services.metrics.snapshot import bytes_by_service, service_of, serving

MAX = 1 << 20


def test_histogram_counts_each_value_in_the_first_bucket_that_holds_it():
    h = Histogram((1, 2, 5))
    for value in (0.5, 1, 1.5, 5, 7):
        h.observe(value)
    assert h.counts == [2, 1, 1, 1] and h.count == 5 and h.sum == 15
    assert cumulative(h.snapshot()) == ([("1.0", 2), ("2.0", 3), ("5.0", 4), ("+Inf", 5)], 5)
    with pytest.raises(ValueError):
        Histogram((2, 1))


def test_a_call_table_keeps_latency_errors_and_bytes_per_method_and_caps_the_names():
    table = CallTable(max_methods=2)
    table.add("a", 0.001, "OK", 10, 20)
    table.add("a", 0.002, "INTERNAL", 1, 2)
    table.add("b", 0.5, "OK", 0, 0)
    table.add("c", 0.1, "NOT_FOUND", 3, 4)  # a third name: counted under OTHER
    snap = table.snapshot()
    assert set(snap) == {"a", "b", OTHER}
    assert sum(snap["a"]["latency"]["counts"]) == 2 and snap["a"]["latency"]["sum"] == pytest.approx(0.003)
    assert snap["a"]["errors"] == {"INTERNAL": 1} and (snap["a"]["received"], snap["a"]["sent"]) == (11, 22)
    assert snap[OTHER]["errors"] == {"NOT_FOUND": 1}
    snap["a"]["errors"]["INTERNAL"] = 99  # a copy: the table is untouched
    assert table.snapshot()["a"]["errors"] == {"INTERNAL": 1}


@pytest.fixture
async def served(nursery):
    """An RpcServer reporting to a CallTable, and a unary caller over memory streams."""
    server = RpcServer(max_frame=MAX)
    server.observer = table = CallTable()

    async def echo(arg, ctx):
        return arg

    async def picky(arg, ctx):
        raise InvalidArgument("never pleased")

    async def broken(arg, ctx):
        raise ValueError("a bug")

    async def slow(arg, ctx):
        await trio.sleep_forever()

    for name, handler in {"echo": echo, "picky": picky, "broken": broken, "slow": slow}.items():
        server.register(name, handler)

    async def open_stream():
        client, server_end = memory_call_stream_pair()
        nursery.start_soon(server.serve_call, server_end, "peer-1")
        return client

    async def call(method, arg=None, timeout=5.0):
        return await unary_call(open_stream, method, arg, timeout, MAX)

    return table, call


async def test_the_server_counts_each_call_that_reached_its_handler_by_how_it_ended(served):
    table, call = served
    for _ in range(3):
        await call("echo", "x" * 100)
    for method, error in (("picky", InvalidArgument), ("broken", Exception), ("slow", DeadlineExceeded),
                          ("nope", Exception)):
        with pytest.raises(error):
            await call(method, timeout=0.05 if method == "slow" else 5.0)
    await trio.testing.wait_all_tasks_blocked()  # the server finishes its side of the last call
    snap = table.snapshot()
    assert set(snap) == {"echo", "picky", "broken", "slow"}  # an unknown name is not a label
    assert sum(snap["echo"]["latency"]["counts"]) == 3 and snap["echo"]["errors"] == {}
    assert snap["echo"]["received"] > 300 and snap["echo"]["sent"] > 300  # request and reply, both ways
    assert snap["picky"]["errors"] == {"INVALID_ARGUMENT": 1}
    assert snap["broken"]["errors"] == {"INTERNAL": 1}
    assert snap["slow"]["errors"] == {"DEADLINE_EXCEEDED": 1}


async def test_peer_rpc_counts_the_calls_it_makes_once_observed(nursery):
    server = RpcServer(max_frame=MAX)

    async def echo(arg, ctx):
        return arg

    async def fail(arg, ctx):
        raise InvalidArgument("no")

    async def total(items, ctx):
        return sum([x async for x in items])

    server.register("echo", echo)
    server.register("fail", fail)
    server.register("total", total, kind="client_stream")

    class Connection:
        def open_stream(self):
            client, server_end = memory_call_stream_pair()
            nursery.start_soon(server.serve_call, server_end, "caller")
            return client

    async def connection(peer):
        return Connection()

    rpc = PeerRpc(connection, RpcConfig())
    peer = Identity.generate().peer_id
    await rpc.call(peer, "echo", 1)  # before observing: not counted
    stats = CallStats()
    rpc.observe(stats)
    assert await rpc.call(peer, "echo", "y" * 50) == "y" * 50
    assert await rpc.client_stream(peer, "total", [1, 2, 3]) == 6
    with pytest.raises(InvalidArgument):
        await rpc.call(peer, "fail")
    called = stats.called.snapshot()
    assert sum(called["echo"]["latency"]["counts"]) == 1
    assert called["echo"]["sent"] > 50 and called["echo"]["received"] > 50
    assert called["fail"]["errors"] == {"INVALID_ARGUMENT": 1}
    assert sum(called["total"]["latency"]["counts"]) == 1 and called["total"]["sent"] > 0
    assert rpc.server.observer is stats.served  # and what it serves, from now on


def test_bytes_are_summed_per_service_by_the_methods_prefix():
    assert (service_of("dht.find_node"), service_of("ping")) == ("dht", "node")
    entry = {"latency": Histogram().snapshot(), "errors": {}, "received": 5, "sent": 7}
    rpc = {"served": {"dht.find_node": entry, "ping": entry}, "called": {"dht.put": entry}}
    assert bytes_by_service(rpc) == {"dht": {"in": 10, "out": 14}, "node": {"in": 5, "out": 7}}


def _snapshot() -> dict:
    latency = Histogram()
    for value in (0.001, 0.002, 0.2):
        latency.observe(value)
    hops = Histogram((1, 2, 3))
    hops.observe(2)
    def entry():
        return {"latency": latency.snapshot(), "errors": {"INTERNAL": 2}, "received": 100, "sent": 300}

    rpc = {"served": {"ping": entry()}, "called": {"dht.find_node": entry()}}
    return {"peer_id": "abc", "uptime_s": 12.5, "recording": True,
            "connections": {"direct": 2, "punched": 0, "relayed": 1},
            "rpc": rpc, "bytes": bytes_by_service(rpc),
            "services": {"dht": {"contacts": 4, "records": 0, "lookups_total": 1, "lookup_hops": hops.snapshot(),
                                 "lookup_timeouts_total": 0, "unanswered_queries_total": 3}}}


def _exposition(snapshot: dict) -> dict:
    """``{(sample name, sorted labels): value}`` of the text a scrape would return."""
    class Static:
        def collect(self):
            return families(snapshot)

    registry = CollectorRegistry()
    registry.register(Static())
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_snapshot_becomes_prometheus_metrics_with_labels():
    samples = _exposition(_snapshot())
    assert samples[("meshd_connections", (("path", "direct"),))] == 2
    assert samples[("meshd_connections", (("path", "relayed"),))] == 1
    assert samples[("meshd_rpc_served_seconds_count", (("method", "ping"),))] == 3
    assert samples[("meshd_rpc_served_seconds_bucket", (("le", "0.0025"), ("method", "ping")))] == 2
    assert samples[("meshd_rpc_called_errors_total", (("code", "INTERNAL"), ("method", "dht.find_node")))] == 2
    assert samples[("meshd_rpc_bytes_total", (("direction", "out"), ("service", "dht")))] == 300
    assert samples[("meshd_dht_lookup_hops_bucket", (("le", "2.0"),))] == 1
    assert samples[("meshd_dht_unanswered_queries_total", ())] == 3
    assert samples[("meshd_dht_contacts", ())] == 4
    assert samples[("meshd_info", (("peer_id", "abc"),))] == 1


def test_every_figure_a_service_gives_is_documented_under_its_own_name(tmp_path):
    from meshd.daemon import SERVICES, Config, build_services

    built = build_services(FakeHost(tmp_path), Config(), SERVICES)
    try:
        metrics = next(s for s in built if isinstance(s, Metrics))
        names = [f"meshd_{name}_{key}".removesuffix("_total")
                 for name, figures in [("rpc", serving(FakeHost(tmp_path))),
                                       *((name, source.figures()) for name, source in metrics._sources.items())]
                 for key in figures]
        assert len(names) == len(set(names))  # one family per name, counters included
        assert not set(names) - set(HELP)
    finally:
        for service in built:
            service.close()


@pytest.mark.parametrize("listen, allow, ok", [
    ("", False, True), ("127.0.0.1:9464", False, True), ("[::1]:0", False, True), ("localhost:9464", False, True),
    ("0.0.0.0:9464", False, False), ("192.0.2.7:9464", False, False), ("0.0.0.0:9464", True, True),
    ("nonsense", False, False),
])
def test_the_exporter_listens_on_loopback_unless_allowed_otherwise(listen, allow, ok):
    section = MetricsSection(listen=listen, allow_remote=allow)
    if ok:
        address = section.address()
        assert (address is None) == (listen == "")
    else:
        with pytest.raises(ConfigError, match="metrics"):
            section.address()


async def test_recording_starts_with_the_first_snapshot(tmp_path):
    host = FakeHost(tmp_path)
    metrics = Metrics(host, MetricsSection(), sources={})
    assert metrics.status() == {"exporter": "off", "recording": False}
    assert host.rpc.server.observer is None  # nothing asked: the RPC layer pays nothing
    snap = await metrics._control_snapshot(None, None)
    assert snap["recording"] and snap["rpc"] == {"served": {}, "called": {}}
    assert snap["services"]["rpc"] == {"calls_waiting": 0, "held_bytes": 0, "refused_frames_total": 0}
    assert host.rpc.server.observer is not None and metrics.status()["recording"]


def test_top_shows_rates_between_two_snapshots():
    before, after = _snapshot(), _snapshot()
    after["uptime_s"] = before["uptime_s"] + 2
    entry = after["rpc"]["served"]["ping"]
    entry["latency"]["counts"][0] += 10
    entry["latency"]["sum"] += 0.004
    entry["sent"] += 2000
    after["bytes"] = bytes_by_service(after["rpc"])
    change = rates(before, after)
    assert change["calls"] == [{"side": "served", "method": "ping", "calls_s": 5.0,
                                "mean_ms": pytest.approx(0.4), "errors": 0}]
    assert {r["service"]: r["out_s"] for r in change["bytes"]} == {"dht": 0, "node": 1000}
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=160).print(render(after, change, [
        {"peer_id": "p" * 56, "path": "relayed", "rtt_ms": 3.5, "streams": 1, "connected_s": 75}]))
    text = out.getvalue()
    for expected in ("relayed 1", "calls/s 5.0", "ping", "1.0 kB", "1m15s", "dht contacts 4"):
        assert expected in text, expected
