"""The DHT across 20 real ``meshd`` processes on 127.0.0.1.

One daemon is the seed; the other 19 bootstrap through it.  Records and
provider announcements made on one node are found from every other, still
after six nodes are SIGKILLed, and a killed node restarted on its data dir
comes back with its routing table and records from ``dht.sqlite``.  The
daemons are driven through their control sockets (``meshd.connect``), and
once through ``meshctl``.  Teardown (the ``daemons`` fixture) kills every
process, pass or fail.
"""

from __future__ import annotations

import trio

from dht.node import DhtConfig
import meshd
from meshd.testing.localmesh import Daemon
from test_daemons import daemons, one_line_error  # noqa: F401  (daemons: the fixture)

NODES = 20
PUT_QUORUM = DhtConfig().put_quorum  # a put returns once this many replicas stored it
KILLED = 6
# Dead peers are noticed in about a second and a dead DHT contact costs 2 s,
# so the run stays short on a small machine.
CONFIG = {
    "transport": {"idle_timeout": 3.0, "keepalive_interval": 0.5, "handshake_timeout": 2.0},
    "dht": {"request_timeout": 2.0},
}
KEY = b"/open/model/latest"
VALUE = b"manifest 5b1f"
CONTENT = b"chunk-manifest-5b1f"


async def each(daemons_: list[Daemon], request) -> list:
    """``await request(client)`` on every daemon's control socket at once, results in order."""
    results: list = [None] * len(daemons_)

    async def one(i: int, daemon: Daemon) -> None:
        async with meshd.connect(daemon.data_dir) as client:
            results[i] = await request(client)

    async with trio.open_nursery() as nursery:
        for i, daemon in enumerate(daemons_):
            nursery.start_soon(one, i, daemon)
    return results


async def wait_until_true(check, what: str, timeout: float) -> None:
    """Re-run async ``check`` until it returns True; fail after ``timeout`` s."""
    with trio.move_on_after(timeout):
        while not await check():
            await trio.sleep(0.2)
        return
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


async def start(make, names: list[str], *, config: dict = CONFIG, **kwargs) -> list[Daemon]:
    """Start daemons in parallel (each start blocks until its ``ready`` line)."""
    started: dict[str, Daemon] = {}

    async def one(name: str) -> None:
        started[name] = await trio.to_thread.run_sync(lambda: make(name, config=config, **kwargs))

    async with trio.open_nursery() as nursery:
        for name in names:
            nursery.start_soon(one, name)
    return [started[name] for name in names]


def value_of(record: dict | None) -> bytes | None:
    return None if record is None else record["value"]


async def test_twenty_daemons_share_records_and_providers_through_failures(daemons):  # noqa: F811
    with trio.fail_after(90):
        [seed] = await start(daemons, ["n00"])
        nodes = [seed] + await start(daemons, [f"n{i:02}" for i in range(1, NODES)],
                                     bootstrap=[str(seed.address)])

        async def joined() -> bool:
            sizes = await each(nodes, lambda client: client.dht_routing())
            return all(info["size"] >= NODES // 2 for info in sizes)

        await wait_until_true(joined, f"every node to know {NODES // 2} others", 30)

        # A record put on one node is found from every other.
        writer, provider = nodes[1], nodes[2]
        assert (await each([writer], lambda client: client.dht_put(KEY, VALUE)))[0] >= PUT_QUORUM
        records = await each(nodes, lambda client: client.dht_get(KEY))
        assert [value_of(r) for r in records] == [VALUE] * NODES
        assert {r["author"] for r in records} == {writer.peer_id}

        # A provider announcement too, with the address to fetch from.
        assert (await each([provider], lambda client: client.dht_provide(CONTENT)))[0] >= NODES // 2
        found = await each(nodes, lambda client: client.dht_providers(CONTENT))
        expected = [{"peer_id": provider.peer_id, "addrs": [str(provider.address.hostport)]}]
        assert found == [expected] * NODES

        # meshctl: text and 0x-hex keys and values.
        put = nodes[3].meshctl("dht", "put", "cli-key", "text value")
        assert put["key"] == "/open/cli-key" and put["replicas"] >= PUT_QUORUM
        assert nodes[4].meshctl("dht", "get", "cli-key")["value"] == "text value"
        assert nodes[3].meshctl("dht", "put", "0xc0ffee", "0x00ff10")["key"] == "0x2f6f70656e2fc0ffee"
        got = nodes[5].meshctl("dht", "get", "0xc0ffee")
        assert (got["value"], got["author"]) == ("0x00ff10", nodes[3].peer_id)
        human = nodes[6].meshctl_raw("dht", "get", "cli-key")
        assert human.returncode == 0 and "text value" in human.stdout, human.stderr
        assert "unknown namespace" in one_line_error(nodes[6].meshctl_raw("dht", "put", "/nope/x", "v"))
        too_large = nodes[6].meshctl_raw("dht", "put", "big", "0x" + "00" * (16 * 1024 + 1))
        assert "0-16384 bytes" in one_line_error(too_large)
        assert "no record under /open/missing" in one_line_error(nodes[6].meshctl_raw("dht", "get", "missing"))

        # kill -9 six nodes (neither the writer nor the provider); the rest still find both.
        victims, survivors = nodes[-KILLED:], nodes[:-KILLED]
        for victim in victims:
            victim.kill()
        records = await each(survivors, lambda client: client.dht_get(KEY))
        assert [value_of(r) for r in records] == [VALUE] * len(survivors)
        found = await each(survivors[3:6], lambda client: client.dht_providers(CONTENT))
        assert found == [expected] * 3

        # A killed node restarted with no bootstrap peers has its routing
        # table and records back from dht.sqlite.
        [back] = await start(daemons, [victims[0].data_dir.name])
        assert back.peer_id == victims[0].peer_id
        [info] = await each([back], lambda client: client.dht_routing())
        assert info["size"] > 0 and info["records"] > 0
        assert {c["peer_id"] for c in info["contacts"]} & {n.peer_id for n in survivors}
        [record] = await each([back], lambda client: client.dht_get(KEY))
        assert value_of(record) == VALUE
