"""miniupnpd, a real UPnP-IGD / NAT-PMP / PCP daemon, on a NAT lab router.

Debian's ``miniupnpd-nftables`` (``apt-get install miniupnpd-nftables``) is the daemon
OpenWrt and many home routers run.  Two things make it work in the lab:

- **Its WAN address is in TEST-NET-2**, which miniupnpd counts as reserved
  and refuses to map for ("Port forwarding is impossible"), even when given
  with ``ext_ip``.  Its documented way out is ``ext_perform_stun=yes``: it
  asks a STUN server whether anything filters in front of its WAN interface
  and, when nothing does, maps for the address STUN saw.  The lab runs
  ``stun_reflector.py`` on a public host for that (nothing does filter
  there: the router's WAN interface is on the public segment itself).
- **nftables**: miniupnpd adds its DNAT and accept rules to chains it does
  not create (``table inet miniupnpd`` here, the layout of its
  ``nft_init.sh``); the lab router's own forward chain drops what comes in
  from the WAN, so ``ct status dnat accept`` is inserted there, as OpenWrt's
  firewall does for port forwards.

It runs in the foreground (``-d``) with its own pid file, config and lease
file in a test directory, so parallel labs never share a file, and the lab
kills it at teardown.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshd.testing.localmesh import wait_until
from natlab import Host

STUN_PORT = 3478
HTTP_PORT = 5000
REFLECTOR = Path(__file__).resolve().parent / "stun_reflector.py"

_CHAINS = """
table inet miniupnpd {
    chain miniupnpd { }
    chain prerouting_miniupnpd { }
    chain postrouting_miniupnpd { }
    chain forward { type filter hook forward priority filter - 10; policy accept; jump miniupnpd; }
    chain prerouting { type nat hook prerouting priority dstnat - 10; policy accept; jump prerouting_miniupnpd; }
    chain postrouting { type nat hook postrouting priority srcnat - 10; policy accept; jump postrouting_miniupnpd; }
}
"""

_CONFIG = """\
ext_ifname=wan0
listening_ip=lan0
http_port={http_port}
enable_upnp={upnp}
enable_natpmp={natpmp}
secure_mode=yes
system_uptime=no
ext_perform_stun=yes
ext_stun_host={stun}
ext_stun_port={stun_port}
upnp_table_name=miniupnpd
upnp_nat_table_name=miniupnpd
upnp_forward_chain=miniupnpd
upnp_nat_chain=prerouting_miniupnpd
upnp_nat_postrouting_chain=postrouting_miniupnpd
lease_file={leases}
min_lifetime=1
max_lifetime=86400
uuid={uuid}
allow 1024-65535 10.0.0.0/8 1024-65535
deny 0-65535 0.0.0.0/0 0-65535
"""


def require_miniupnpd() -> str:
    """The miniupnpd binary, or pytest.skip saying how to install it."""
    path = shutil.which("miniupnpd") or shutil.which("/usr/sbin/miniupnpd")
    if path is None:
        pytest.skip("miniupnpd is not installed (apt-get install miniupnpd-nftables)")
    return path


@dataclass(frozen=True)
class LeaseEntry:
    """One line of miniupnpd's lease file: a mapping it holds."""

    protocol: str
    external_port: int
    internal_address: str
    internal_port: int
    expires: int  # the lease's end (miniupnpd's clock, seconds); 0 for a permanent one
    description: str


class Miniupnpd:
    """miniupnpd on ``router`` (UPnP-IGD and/or NAT-PMP + PCP), vouched for by a STUN reflector on ``stun``."""

    def __init__(self, router: Host, stun: Host, workdir: Path, *, upnp: bool = True, natpmp: bool = True):
        self.router = router
        self.workdir = workdir
        self.lease_file = workdir / "leases"
        self.log_file = workdir / "miniupnpd.log"
        binary = require_miniupnpd()
        workdir.mkdir(parents=True, exist_ok=True)
        reflector = stun.popen([sys.executable, str(REFLECTOR), stun.address, str(STUN_PORT)],
                               stdout=subprocess.PIPE, text=True)
        if reflector.stdout.readline().strip() != "ready":
            raise RuntimeError("the STUN reflector did not start")
        router.run(["nft", "-f", "-"], input=_CHAINS)
        router.run(["nft", "insert", "rule", "ip", "natlab", "forward", "ct", "status", "dnat", "accept"])
        config = workdir / "miniupnpd.conf"
        config.write_text(_CONFIG.format(http_port=HTTP_PORT, upnp="yes" if upnp else "no",
                                         natpmp="yes" if natpmp else "no", stun=stun.address,
                                         stun_port=STUN_PORT, leases=self.lease_file, uuid=uuid.uuid4()))
        with open(self.log_file, "w") as log:
            self.proc = router.popen([binary, "-d", "-f", str(config), "-P", str(workdir / "pid")],
                                     stdout=log, stderr=subprocess.STDOUT)
        ready = "Listening for NAT-PMP/PCP traffic" if natpmp else "HTTP listening on port"
        wait_until(lambda: ready in self.log() or self.proc.poll() is not None, 20, "miniupnpd to start")
        if self.proc.poll() is not None or "Port forwarding is now enabled" not in self.log():
            raise RuntimeError(f"miniupnpd did not start mapping:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")

    def leases(self) -> list[LeaseEntry]:
        """The mappings in miniupnpd's lease file (PROTO:EPORT:IADDR:IPORT:EXPIRES:DESC lines)."""
        if not self.lease_file.exists():
            return []
        entries = []
        for line in self.lease_file.read_text().splitlines():
            protocol, eport, iaddr, iport, expires, description = line.split(":", 5)
            entries.append(LeaseEntry(protocol, int(eport), iaddr, int(iport), int(expires), description))
        return entries

    def redirects(self) -> str:
        """The DNAT rules miniupnpd holds in the router's nftables (its prerouting chain)."""
        return self.router.run(["nft", "list", "chain", "inet", "miniupnpd", "prerouting_miniupnpd"]).stdout
