"""A snapshot (:mod:`.snapshot`) as Prometheus metric families; :data:`HELP` names every one."""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    Metric)

from ...histogram import cumulative, is_histogram

HELP = {
    "meshd_info": "This node: its PeerId (value 1)",
    "meshd_uptime_seconds": "Seconds since the node started",
    "meshd_connections": "Open peer connections by path (direct, punched, relayed)",
    "meshd_rpc_served_seconds": "Seconds the calls this node served ran, by method",
    "meshd_rpc_served_errors": "Served calls that ended in an error, by method and code",
    "meshd_rpc_called_seconds": "Seconds the unary and client-streaming calls this node made took, by method",
    "meshd_rpc_called_errors": "Calls this node made that failed, by method and code",
    "meshd_rpc_bytes": "RPC bytes by service (the method's prefix; node for the core) and direction",
    "meshd_rpc_calls_waiting": "Served calls waiting for their turn (a busy node, a peer past its share)",
    "meshd_rpc_held_bytes": "Bytes the calls this node serves hold: requests, and answers not yet queued",
    "meshd_rpc_refused_frames": "Frames refused for passing a peer's or the node's byte budget",
    "meshd_dht_contacts": "Contacts in the DHT routing table",
    "meshd_dht_records": "DHT records stored here",
    "meshd_dht_lookups": "DHT lookups run",
    "meshd_dht_lookup_hops": "Hops on the longest path to the nearest nodes that ended a DHT lookup",
    "meshd_dht_lookup_timeouts": "DHT lookups ended by lookup_timeout",
    "meshd_dht_unanswered_queries": "DHT queries that got no answer (timed out, or peer unreachable)",
    "meshd_nat_relay_reservations": "Relay reservations held here, as a relay",
    "meshd_nat_relay_circuits": "Relayed circuits open here, as a relay",
    "meshd_nat_relay_circuits_opened": "Relayed circuits opened here since start",
    "meshd_nat_relay_bytes": "Bytes carried by relayed circuits here, both ways",
    "meshd_crdt_documents": "Documents kept here",
    "meshd_crdt_unsent_changes": "Document changes waiting to be pushed to peers",
    "meshd_crdt_sync_lag_seconds": "Seconds from a peer's change being signed to its arrival here",
    "meshd_shards_fetches": "Model fetches in progress",
    "meshd_shards_fetch_have_bytes": "Bytes the fetches in progress have",
    "meshd_shards_fetch_total_bytes": "Bytes the fetches in progress need in all",
    "meshd_shards_fetched_bytes": "Bytes received by model fetches since start",
}


def families(snapshot: dict) -> Iterator[Metric]:
    """Every metric of ``snapshot``: the node's, the RPC tables', then each service's figures."""
    info = GaugeMetricFamily("meshd_info", HELP["meshd_info"], labels=["peer_id"])
    info.add_metric([snapshot["peer_id"]], 1)
    yield info
    yield GaugeMetricFamily("meshd_uptime_seconds", HELP["meshd_uptime_seconds"], value=snapshot["uptime_s"])
    connections = GaugeMetricFamily("meshd_connections", HELP["meshd_connections"], labels=["path"])
    for path, count in sorted(snapshot["connections"].items()):
        connections.add_metric([path], count)
    yield connections
    for side, table in snapshot["rpc"].items():
        yield from _calls(side, table)
    moved = CounterMetricFamily("meshd_rpc_bytes", HELP["meshd_rpc_bytes"], labels=["service", "direction"])
    for service, counts in sorted(snapshot["bytes"].items()):
        for direction, count in counts.items():
            moved.add_metric([service, direction], count)
    yield moved
    for service, figures in snapshot["services"].items():
        for key, value in figures.items():
            yield _figure(f"meshd_{service}_{key}", value)


def _calls(side: str, table: dict) -> Iterator[Metric]:
    """Latency histograms and error counts of one side (served or called), by method."""
    name = f"meshd_rpc_{side}"
    latency = HistogramMetricFamily(f"{name}_seconds", HELP[f"{name}_seconds"], labels=["method"])
    errors = CounterMetricFamily(f"{name}_errors", HELP[f"{name}_errors"], labels=["method", "code"])
    for method, entry in sorted(table.items()):
        buckets, _ = cumulative(entry["latency"])
        latency.add_metric([method], buckets, entry["latency"]["sum"])
        for code, count in sorted(entry["errors"].items()):
            errors.add_metric([method, code], count)
    yield latency
    yield errors


def _figure(name: str, value: object) -> Metric:
    """One service figure: a histogram snapshot, a counter (``..._total``) or a gauge."""
    if is_histogram(value):
        family = HistogramMetricFamily(name, HELP.get(name, ""))
        buckets, _ = cumulative(value)
        family.add_metric([], buckets, value["sum"])
        return family
    if name.endswith("_total"):
        name = name.removesuffix("_total")
        return CounterMetricFamily(name, HELP.get(name, ""), value=value)
    return GaugeMetricFamily(name, HELP.get(name, ""), value=value)
