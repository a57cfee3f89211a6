"""A NAT-PMP gateway for the NAT lab's home routers (run inside a router namespace).

    python tests/natpmp_gateway.py LAN_IP WAN_IP

Answers RFC 6886 requests on LAN_IP:5351 (and PCP requests with NAT-PMP's
"unsupported version", as RFC 6886 section 3.5 says) and maps ports with real nftables
DNAT rules in the router's ``natlab`` table, the way a home router's UPnP/
NAT-PMP daemon does.  A NAT-PMP-only gateway, for the PCP fallback; the real
miniupnpd is in ``miniupnpd.py``.  Prints ``ready`` once it listens.
"""

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from nat import natpmp  # noqa: E402


def nft(*args: str) -> str:
    return subprocess.run(["nft", *args], check=True, capture_output=True, text=True).stdout


def main(lan_ip: str, wan_ip: str) -> None:
    started = time.monotonic()
    rules: dict[tuple[str, int], tuple[int, int]] = {}  # (client, internal) -> (external, handle)
    nft("insert", "rule", "ip", "natlab", "forward", "ct", "status", "dnat", "accept")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((lan_ip, natpmp.PORT))
    print("ready", flush=True)
    while True:
        data, (client, port) = sock.recvfrom(64)
        epoch = int(time.monotonic() - started)
        if len(data) >= 2 and data[0] != natpmp.VERSION:  # a PCP request: tell it to speak NAT-PMP
            sock.sendto(natpmp.unsupported_version_response(epoch, data[1]), (client, port))
            continue
        try:
            opcode, asked = natpmp.parse_request(data)
        except natpmp.NatPmpError:
            continue
        if opcode == natpmp.OP_EXTERNAL_ADDRESS:
            sock.sendto(natpmp.external_address_response(epoch, wan_ip), (client, port))
            continue
        key = (client, asked.internal_port)
        if key in rules:
            external, handle = rules.pop(key)
            nft("delete", "rule", "ip", "natlab", "prerouting", "handle", str(handle))
        if asked.lifetime == 0:
            granted = natpmp.Mapping(asked.internal_port, 0, 0)
        else:
            external = asked.external_port or asked.internal_port
            out = nft("-e", "-a", "add", "rule", "ip", "natlab", "prerouting", "iifname", "wan0",
                      "udp", "dport", str(external), "dnat", "to", f"{client}:{asked.internal_port}")
            rules[key] = (external, int(re.search(r"# handle (\d+)", out).group(1)))
            granted = natpmp.Mapping(asked.internal_port, external, asked.lifetime)
        sock.sendto(natpmp.map_udp_response(epoch, granted), (client, port))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
