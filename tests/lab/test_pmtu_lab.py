"""Path MTU discovery between real daemons across veths and routers of set MTUs.

The daemons log what the search settled on ("path MTU to PEER at ADDR:
datagrams of N bytes"); the tests read it there and move data across to show
the size works.  The routers drop the ICMP "fragmentation needed" they would
send (``Host.block_packet_too_big``), so a too-large packet simply vanishes:
the black-hole case DPLPMTUD is built for.
"""

from __future__ import annotations

import re

import trio

import meshd
from meshd.testing.localmesh import wait_until
from natlab import natlab  # noqa: F401 (the fixture)

ECHO = 2 << 20  # bytes each way through the node's ping (an echo)


def settled_size(daemon, peer) -> int | None:
    """The datagram size ``daemon``'s latest path-MTU search to ``peer`` settled on, if any."""
    found = re.findall(rf"path MTU to {peer} at \S+: datagrams of (\d+) bytes", daemon.log_path.read_text())
    return int(found[-1]) if found else None


def sizes(a, b, timeout: float = 20.0) -> tuple[int, int]:
    """Both directions' settled sizes, once both searches are done."""
    return wait_until(lambda: (settled_size(a, b.peer_id) and settled_size(b, a.peer_id)
                               and (settled_size(a, b.peer_id), settled_size(b, a.peer_id))),
                      timeout, "both path-MTU searches to settle")


def echo(client, server) -> None:
    async def call():
        async with meshd.connect(client.data_dir) as c:
            assert await c.call(server.peer_id, "ping", b"x" * ECHO, timeout=30) == b"x" * ECHO
    trio.run(call)


def test_a_1500_byte_path_carries_datagrams_of_almost_1472_bytes(natlab, tmp_path):
    a = natlab.public_host("a").daemon(tmp_path / "a")
    b = natlab.public_host("b").daemon(tmp_path / "b", bootstrap=[a.dial_address])
    for size in sizes(a, b):
        assert 1400 < size <= 1500 - 28
    echo(b, a)
    transport = b.meshctl("status")["transport"]
    assert transport["pmtu_searches_done"] >= 1 and "pmtu_black_holes" not in transport


def test_a_1300_byte_router_between_9000_byte_links_is_found_without_icmp(natlab, tmp_path):
    a_host = natlab.public_host("a", mtu=9000)
    b_host = natlab.nat_host("b", "home", mtu=9000, wan_mtu=1300)
    b_host.router.block_packet_too_big()
    assert (a_host.link_mtu("wan0"), b_host.router.link_mtu("wan0"), b_host.link_mtu("eth0")) == (9000, 1300, 9000)
    a = a_host.daemon(tmp_path / "a")
    b = b_host.daemon(tmp_path / "b", bootstrap=[a.dial_address])
    for size in sizes(a, b):
        assert 1200 < size <= 1300 - 28
    echo(b, a)


def test_a_path_that_shrinks_under_a_connection_is_a_black_hole_it_gets_out_of(natlab, tmp_path):
    a_host = natlab.public_host("a", mtu=9000)
    b_host = natlab.nat_host("b", "home", mtu=9000, wan_mtu=9000)
    b_host.router.block_packet_too_big()
    a = a_host.daemon(tmp_path / "a")
    b = b_host.daemon(tmp_path / "b", bootstrap=[a.dial_address])
    assert sizes(a, b) == (8972, 8972)
    b_host.router.run(["ip", "link", "set", "wan0", "mtu", "1300"])  # now 1300 in the middle, silently
    echo(b, a)  # full-size packets vanish until the sender notices
    wait_until(lambda: "stopped arriving" in b.log_path.read_text(), 10, "b to detect the black hole")
    assert b.meshctl("status")["transport"]["pmtu_black_holes"] >= 1
    wait_until(lambda: (settled_size(b, a.peer_id) or 9000) <= 1272, 20, "b's search to settle again")
    echo(b, a)
