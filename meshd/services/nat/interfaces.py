"""This host's interface addresses: where host candidates and LAN beacons come from."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
import sys
from pathlib import Path

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
_IF_INET6 = Path("/proc/net/if_inet6")
_GLOBAL_DESTINATIONS = ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1"))  # documentation


def interface_addresses() -> list[str]:
    """The IP addresses of this host's network interfaces as texts, IPv4 first, without repeats.

    On Linux: each interface's IPv4 address (its primary one, SIOCGIFADDR)
    and every IPv6 address (``/proc/net/if_inet6``).  Elsewhere: per family,
    the source address the kernel would pick towards a global destination
    (a UDP ``connect``, which sends nothing), so only the interface of the
    default route.  Loopback and link-local addresses are included (callers
    filter); an interface that cannot be read is skipped, never an error.
    """
    found = _linux_addresses() if sys.platform.startswith("linux") else _routed_addresses()
    return list(dict.fromkeys(found))


def _linux_addresses() -> list[str]:
    import fcntl  # POSIX only

    v4 = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            with contextlib.suppress(OSError):  # no IPv4 address on it, or gone meanwhile
                v4.append(socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)[20:24]))
    v6 = []
    with contextlib.suppress(OSError):
        for line in _IF_INET6.read_text().splitlines():
            fields = line.split()
            with contextlib.suppress(IndexError, ValueError):
                v6.append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    return v4 + v6


def _routed_addresses() -> list[str]:
    found = []
    for family, destination in _GLOBAL_DESTINATIONS:
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((destination, 9))
            found.append(sock.getsockname()[0])
    return found
