"""Peers at one site talk directly: two hosts behind one NAT router, plus a public relay.

The site's router (``NatLab.site``) masquerades like a home router and does
not hairpin, so a path through its public address never works between its
own hosts: without host candidates two of them stay on the relayed path.
With them (the default), the hole-punch exchange carries each side's LAN
address and they end up on a direct LAN path.  LAN discovery (multicast
beacons) connects two daemons of one segment with no bootstrap at all.
"""

import pytest

from meshd.testing.localmesh import wait_until
from natlab import natlab  # noqa: F401 (the fixture)


def row_for(daemon, peer_id):
    """``daemon``'s ``meshctl peers`` row for ``peer_id``, or None."""
    return next((row for row in daemon.meshctl("peers") if row["peer_id"] == peer_id), None)


def on_lan_path(daemon, other):
    """Whether ``daemon`` talks to ``other`` directly, at ``other``'s LAN address."""
    row = row_for(daemon, other.peer_id)
    return row is not None and row["path"] != "relayed" and row["address"] == f"{other.host.address}:{other.port}"


def call_both_ways(a, b):
    assert a.meshctl("call", b.peer_id, "ping", '"a->b"', timeout=60) == "a->b"
    assert b.meshctl("call", a.peer_id, "ping", '"b->a"', timeout=60) == "b->a"


def site_pair(lab, tmp_path, kind="home", **nat):
    """Two daemons at one site behind a router of ``kind`` that know only the relay's address
    (the relay and a second public node are their STUN servers); LAN discovery off."""
    relay = lab.public_host("relay").daemon(tmp_path / "relay", config={"relay": {"enabled": True}})
    stun = lab.public_host("stun").daemon(tmp_path / "stun")
    config = {"nat": {"stun_servers": [relay.udp_address, stun.udp_address], "lan_discovery": False, **nat}}
    hosts = lab.site("office", kind=kind)
    a, b = (h.daemon(tmp_path / h.name, bootstrap=[relay.dial_address], config=config) for h in hosts)
    for d in (a, b):
        wait_until(lambda d=d: relay.peer_id in d.meshctl("relay")["reserved_at"], 20, "a relay reservation")
        wait_until(lambda d=d: d.meshctl("nat")["mapping"], 20, "STUN discovery at start")
    return a, b


@pytest.mark.parametrize("kind", ["home", "symmetric"])
def test_two_hosts_behind_one_nat_end_up_on_a_direct_lan_path(natlab, tmp_path, kind):  # noqa: F811
    a, b = site_pair(natlab, tmp_path, kind)
    # behind a symmetric router no NAT method can work (both sides hard): the LAN path is tried alone
    assert a.meshctl("nat")["mapping"] == ("endpoint-independent" if kind == "home" else "endpoint-dependent")
    assert a.meshctl("nat")["host_candidates"] == [f"{a.host.address}:{a.port}"]
    # a knows b by PeerId alone: the first call goes through the relay, punching follows
    call_both_ways(a, b)
    wait_until(lambda: on_lan_path(a, b) and on_lan_path(b, a), 30, "a direct LAN path on both sides")
    call_both_ways(a, b)
    assert on_lan_path(a, b) and on_lan_path(b, a)


def test_without_host_candidates_the_same_pair_stays_relayed(natlab, tmp_path):  # noqa: F811
    a, b = site_pair(natlab, tmp_path, host_candidates=False)
    assert a.meshctl("nat")["host_candidates"] == []
    call_both_ways(a, b)
    assert a.meshctl("punch", b.peer_id, timeout=60)["punched"] is False  # the NAT does not hairpin
    assert row_for(a, b.peer_id)["path"] == "relayed"
    call_both_ways(a, b)


@pytest.mark.parametrize("first", ["a", "b"])
def test_two_daemons_with_no_bootstrap_find_each_other_on_the_lan(natlab, tmp_path, first):  # noqa: F811
    hosts = dict(zip("ab", natlab.site("office")))
    # the one started first hears the other's first beacon; the order must not matter
    started = {name: hosts[name].daemon(tmp_path / name) for name in (first, "b" if first == "a" else "a")}
    a, b = started["a"], started["b"]
    wait_until(lambda: on_lan_path(a, b) and on_lan_path(b, a), 20, "each to find the other on the LAN")
    call_both_ways(a, b)
    assert a.meshctl("nat")["lan_discovery"]["interfaces"] == [a.host.address]
    assert row_for(a, b.peer_id)["path"] == "direct"
