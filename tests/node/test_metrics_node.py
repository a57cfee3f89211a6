"""The metrics exporter of an in-process node, scraped over HTTP like Prometheus does."""

from __future__ import annotations

import urllib.request

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import meshd
from meshd import Config
from meshd.rpc import InvalidArgument


async def _scrape(address: str) -> dict:
    """``{(sample name, sorted labels): value}`` from ``http://ADDRESS/metrics``."""
    def get() -> str:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
            return reply.read().decode()

    text = await trio.to_thread.run_sync(get)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_a_scrape_shows_latency_by_method_and_connections_by_path(tmp_path):
    config = Config()
    config.metrics.listen = "127.0.0.1:0"
    async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0", config=config) as a, \
            meshd.open_node(tmp_path / "b", listen="127.0.0.1:0") as b:
        exporter = a.service("metrics").exporting
        assert exporter.startswith("127.0.0.1:") and not exporter.endswith(":0")
        b.service("metrics").record()
        await b.connect(a.address)
        for _ in range(5):
            await b.rpc.call(a.peer_id, "ping", "x" * 1000)
        with pytest.raises(InvalidArgument):
            await b.rpc.call(a.peer_id, "dht.find_node", "not a map")
        samples = await _scrape(exporter)
        assert samples[("meshd_rpc_served_seconds_count", (("method", "ping"),))] == 5
        assert samples[("meshd_rpc_served_seconds_bucket", (("le", "+Inf"), ("method", "ping")))] == 5
        assert samples[("meshd_rpc_served_errors_total",
                        (("code", "INVALID_ARGUMENT"), ("method", "dht.find_node")))] == 1
        assert samples[("meshd_connections", (("path", "direct"),))] == 1
        assert samples[("meshd_connections", (("path", "relayed"),))] == 0
        assert samples[("meshd_rpc_bytes_total", (("direction", "in"), ("service", "node")))] > 5000
        assert samples[("meshd_info", (("peer_id", str(a.peer_id)),))] == 1
        assert ("process_resident_memory_bytes", ()) in samples
        called = b.service("metrics").snapshot()["rpc"]["called"]
        assert sum(called["ping"]["latency"]["counts"]) == 5
        assert called["dht.find_node"]["errors"] == {"INVALID_ARGUMENT": 1}
        assert b.service("metrics").status() == {"exporter": "off", "recording": True}


async def test_a_node_refuses_an_exporter_beyond_loopback_unless_allowed(tmp_path):
    config = Config()
    config.metrics.listen = "0.0.0.0:0"
    with pytest.raises(meshd.ConfigError, match="allow_remote"):
        async with meshd.open_node(tmp_path / "a", listen="127.0.0.1:0", config=config):
            pass
