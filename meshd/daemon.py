"""The composition root: which services a node runs, and in what order.

:data:`SERVICES` lists every service a daemon knows, in the order they are
built and started; :func:`build_services` builds those ``[node] services``
names, handing each service the others it needs; :func:`open_node` is the way
in for a daemon or an in-process user.  A new capability is one subpackage of
:mod:`meshd.services`, one section in :class:`Config` and one step in
:func:`build_services`.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Sequence

import trio

from .config import ConfigError, CoreConfig, NodeConfig
from .node import Node
from .service import Service
from .services.crdt import Crdt, CrdtSection
from .services.dht import Dht, DhtSection
from .services.experts import Experts, ExpertsSection
from .services.learning import Learning, LearningSection
from .services.metrics import Metrics, MetricsSection
from .services.nat import Nat, NatSection, RelaySection
from .services.shards import Shards, ShardsSection

SERVICES = ("nat", "dht", "crdt", "shards", "learning", "experts", "metrics")
NEEDS = {"crdt": ("dht",), "shards": ("dht", "crdt"), "learning": ("dht",), "experts": ("dht",)}


@dataclass
class Config(CoreConfig):
    """Every section a daemon reads: the core's and each service's."""

    node: NodeConfig = field(default_factory=lambda: NodeConfig(services=list(SERVICES)))
    nat: NatSection = field(default_factory=NatSection)
    relay: RelaySection = field(default_factory=RelaySection)
    dht: DhtSection = field(default_factory=DhtSection)
    crdt: CrdtSection = field(default_factory=CrdtSection)
    shards: ShardsSection = field(default_factory=ShardsSection)
    learning: LearningSection = field(default_factory=LearningSection)
    experts: ExpertsSection = field(default_factory=ExpertsSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)


def check_services(names: Sequence[str]) -> list[str]:
    """``names`` in start order; ConfigError for an unknown name or a missing dependency."""
    for name in names:
        if name not in SERVICES:
            raise ConfigError(f"node.services: unknown service {name!r} (known: {', '.join(SERVICES)})")
        for needed in NEEDS.get(name, ()):
            if needed not in names:
                raise ConfigError(f"node.services: {name} needs {needed}")
    return [name for name in SERVICES if name in names]


def build_services(host: Node, config: Config, names: Sequence[str]) -> list[Service]:
    """The services called ``names``, built in order, each given what it needs."""
    names = check_services(names)
    built: list[Service] = []
    nat = dht = crdt = shards = None
    if "nat" in names:
        nat = Nat(host, config.nat, config.relay)
        built.append(nat)
    if "dht" in names:
        dht = Dht(host, config.dht, backoff_cap=config.peers.bootstrap_max_backoff,
                  reachability=nat.autonat if nat else None,
                  wait_for_verdict=bool(nat and nat.configured_stun), relays=nat)
        built.append(dht)
    if "crdt" in names:
        crdt = Crdt(host, config.crdt, providers=dht.node)
        built.append(crdt)
    if "shards" in names:
        shards = Shards(host, config.shards, providers=dht.node, records=dht.node, documents=crdt, lane=config.lane)
        built.append(shards)
    if "learning" in names:
        built.append(Learning(host, config.learning, providers=dht.node, documents=crdt, states=shards,
                              lane=config.lane))
    if "experts" in names:
        built.append(Experts(host, config.experts, providers=dht.node, documents=crdt))
    if "metrics" in names:  # last: it reads the figures of those before it
        sources = {"nat": nat, "dht": dht, "crdt": crdt, "shards": shards}
        built.append(Metrics(host, config.metrics,
                             sources={name: s for name, s in sources.items() if s is not None}))
    return built


FAREWELL_SECONDS = 2.0  # the most a stopping node waits for its services' goodbyes


@asynccontextmanager
async def open_node(
    data_dir: str | Path,
    *,
    listen: str | list[str] | None = None,
    bootstrap: list[str] | None = None,
    config: Config | None = None,
    services: Sequence[str] | None = None,
) -> AsyncIterator[Node]:
    """Start a node with its state in ``data_dir``; stop it cleanly on exit.

    ``listen``, ``bootstrap`` and ``services`` (names from :data:`SERVICES`)
    override the config file.  The identity key is created on first use.
    Leaving the block (or cancelling it) first lets the services say goodbye
    (a training group's members stop counting this one; at most
    :data:`FAREWELL_SECONDS`), then closes every connection (peers are told),
    then each service's files (the DHT saves its routing table) and the peer
    store.
    """
    data_dir = Path(data_dir).expanduser()
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    config = config or Config.load(data_dir)
    if listen is not None:
        if isinstance(listen, list):
            if len(listen) != 1:
                raise ValueError(
                    "meshd listens on one UDP socket; use [::]:PORT for IPv4 and IPv6 together"
                )
            listen = listen[0]
        config.node.listen = listen
    if bootstrap is not None:
        config.node.bootstrap = list(bootstrap)
    names = check_services(config.node.services if services is None else services)
    node = Node(data_dir, config)
    try:
        for service in build_services(node, config, names):
            node.add_service(service)
        node.off = tuple(name for name in SERVICES if name not in names)
        running = trio.CancelScope()

        async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
            with running:
                await node.run(task_status=task_status)

        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            running.shield = True  # a cancelled block still says its goodbyes before the node stops
            try:
                yield node
            finally:
                with trio.move_on_after(FAREWELL_SECONDS, shield=True):
                    await node.farewell()
                node.close_connections()
                running.cancel()
                nursery.cancel_scope.cancel()
    finally:
        node.close()
