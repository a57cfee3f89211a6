"""Port mapping against a real gateway daemon: miniupnpd (UPnP-IGD, PCP, NAT-PMP) in the NAT lab.

miniupnpd runs on a home router of the lab (``tests/support/miniupnpd.py``
says how it is configured); a meshd daemon behind it maps its port by one
protocol, renews a short lease past its end, is dialed at the mapped address
by a public stranger, and deletes the mapping when it stops.
"""

import pytest

from meshd.testing.localmesh import wait_until
from miniupnpd import Miniupnpd, require_miniupnpd
from natlab import natlab  # noqa: F401 (the fixture)

LIFETIME = 4  # seconds: renewed every 2 s, so a test sees the first lease end


@pytest.mark.parametrize("protocol, protocols, gateway_natpmp", [
    ("pcp", ["pcp", "natpmp", "upnp"], True),  # the default order: PCP answers first
    ("natpmp", ["natpmp"], True),
    ("upnp", ["pcp", "natpmp", "upnp"], False),  # no PCP/NAT-PMP service: on to UPnP
])
def test_a_node_maps_renews_and_deletes_its_port_at_miniupnpd(natlab, tmp_path, protocol, protocols,  # noqa: F811
                                                               gateway_natpmp):
    require_miniupnpd()
    home = natlab.nat_host("home", "home")
    pub = natlab.public_host("pub")
    igd = Miniupnpd(home.router, pub, tmp_path / "igd", natpmp=gateway_natpmp)
    stranger = pub.daemon(tmp_path / "pub")
    node = home.daemon(tmp_path / "home", config={"nat": {"port_mapping_protocols": protocols,
                                                          "port_mapping_lifetime": LIFETIME}})

    mapping = wait_until(lambda: node.meshctl("nat")["port_mapping"], 20, "a port mapping")
    assert mapping == {"gateway": home.router.address, "external": f"{home.wan_address}:4100",
                       "lifetime": LIFETIME, "protocol": protocol}
    [lease] = igd.leases()
    assert (lease.protocol, lease.external_port, lease.internal_address, lease.internal_port) == \
        ("UDP", 4100, home.address, 4100)

    # renewed before it lapses: a lease granted after the first one's end, and the rule still there
    wait_until(lambda: any(e.expires >= lease.expires + LIFETIME for e in igd.leases()), 20,
               "a renewal past the first lease's end")
    assert f"dnat ip to {home.address}:4100" in igd.redirects()

    # no relay, no punching: the stranger dials the mapped address and calls both ways
    stranger.meshctl("connect", f"{node.peer_id}@{mapping['external']}")
    assert stranger.meshctl("call", node.peer_id, "ping", '"mapped"') == "mapped"
    assert node.meshctl("call", stranger.peer_id, "ping", '"back"') == "back"

    # a clean shutdown deletes the mapping at the gateway
    assert node.stop() == 0
    assert igd.leases() == []
    assert "dnat" not in igd.redirects()
