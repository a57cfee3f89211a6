"""A soak cluster in the NAT lab: a public bootstrap node that relays and answers
STUN, and hosts behind home and symmetric NATs; each NAT host's link can be cut
(its router stops forwarding) and restored.  Used by ``tests/lab/test_soak_lab.py``
and ``benchmarks/soak.py``.
"""

from __future__ import annotations

from pathlib import Path

from meshd.testing.soak import Cluster, Cut, Slot
from natlab import DEFAULT_PORT, Host, NatLab

# a table of its own in the router, so restoring never touches the NAT's rules
_CUT = """
table ip soak_cut {
    chain forward {
        type filter hook forward priority filter - 10; policy drop;
    }
}
"""


def router_cut(host: Host) -> Cut:
    """Cutting ``host`` off: its router drops everything it would forward, both ways."""
    return Cut(host.name, cut=lambda: host.router.run(["nft", "-f", "-"], input=_CUT),
               restore=lambda: host.router.run(["nft", "delete", "table", "ip", "soak_cut"]))


def lab_cluster(lab: NatLab, root: Path, nat_hosts: int, config: dict, name: str = "lab") -> Cluster:
    """A public seed (relay on), a second public node, and ``nat_hosts`` hosts behind NATs
    (home, symmetric, home, ...).  The NATed nodes are DHT clients (AutoNAT finds them
    unreachable), so the two public nodes are the DHT's servers."""
    boot = lab.public_host(f"{name}-boot")
    stun = {**config, "nat": {**config.get("nat", {}), "stun_servers": [f"{boot.address}:{DEFAULT_PORT}"]}}
    hosts = [lab.public_host(f"{name}-pub")]
    hosts += [lab.nat_host(f"{name}-{i}", "symmetric" if i % 2 else "home") for i in range(nat_hosts)]

    def slot(host: Host, slot_config: dict) -> Slot:
        data_dir = Path(root) / host.name
        return Slot(host.name, lambda bootstrap: host.daemon(data_dir, start=False, bootstrap=bootstrap,
                                                             config=slot_config))

    relay = {**config, "relay": {"enabled": True}}
    return Cluster(name, [slot(boot, relay)] + [slot(host, stun) for host in hosts],
                   cuts=[router_cut(host) for host in hosts[1:]])
