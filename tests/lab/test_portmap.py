"""Port mapping by NAT-PMP through a real nftables home router in the NAT lab.

The gateway is ``tests/support/natpmp_gateway.py``, which speaks NAT-PMP
only: the node asks in PCP first and falls back on its "unsupported
version" answer (RFC 6887 appendix A).  ``test_miniupnpd.py`` runs the real
miniupnpd.
"""

import subprocess
import sys
from pathlib import Path

from meshd.testing.localmesh import wait_until
from meshd.services.nat.portmap import default_gateway
from natlab import natlab  # noqa: F401 (the fixture)

GATEWAY = Path(__file__).resolve().parents[1] / "support" / "natpmp_gateway.py"


def test_default_gateway_is_read_from_the_routing_table(tmp_path):
    table = tmp_path / "route"
    table.write_text(
        "Iface\tDestination\tGateway\tFlags\n"
        "eth0\t0000000A\t00000000\t0001\n"
        "eth0\t00000000\t0100000A\t0003\n"
    )
    assert default_gateway(str(table)) == "10.0.0.1"
    table.write_text("Iface\tDestination\tGateway\tFlags\n")
    assert default_gateway(str(table)) is None


def test_a_home_node_maps_its_port_and_strangers_dial_it_directly(natlab, tmp_path):  # noqa: F811
    home = natlab.nat_host("home", "home")
    gateway = home.router.popen([sys.executable, str(GATEWAY), home.router.address, home.wan_address],
                                stdout=subprocess.PIPE, text=True)
    assert gateway.stdout.readline().strip() == "ready"
    stranger = natlab.public_host("pub").daemon(tmp_path / "pub")
    node = home.daemon(tmp_path / "home")

    mapping = wait_until(lambda: node.meshctl("nat")["port_mapping"], 15, "a port mapping")
    assert mapping["external"] == f"{home.wan_address}:4100"
    assert mapping["gateway"] == home.router.address
    assert mapping["protocol"] == "natpmp"  # after PCP met "unsupported version"

    # no relay, no punching: the stranger dials the mapped address and calls both ways
    stranger.meshctl("connect", f"{node.peer_id}@{mapping['external']}")
    assert stranger.meshctl("call", node.peer_id, "ping", '"mapped"') == "mapped"
    assert node.meshctl("call", stranger.peer_id, "ping", '"back"') == "back"

    # a clean shutdown deletes the mapping on the gateway
    assert node.stop() == 0
    rules = home.router.run(["nft", "list", "chain", "ip", "natlab", "prerouting"]).stdout
    assert "dnat to" not in rules
