"""A small internet in network namespaces, for NAT traversal tests.

Topology (every box is a network namespace named ``natlab-PID-RAND-ROLE``)::

    ROLE "_inet": bridge br0, the public segment 198.51.100.0/24 (a plain switch)
       |            |                       |
     [pub A]     [pub B]            [router of X]  wan0 198.51.100.N, nftables NAT
     .10          .11                      |       lan0 10.K.0.1/24
                                       [host X]    eth0 10.K.0.2/24, default via 10.K.0.1

``NatLab.site`` puts several hosts (10.K.0.2, .3, ...) on one LAN, a bridge
behind one router: an office, a lab, a home with two machines.

Nothing is created in the root namespace and nothing is routed anywhere but
between these namespaces: public hosts have no default route, routers have
none either, so a packet for any other address is unreachable.

NAT kinds (nftables in the router namespace, ``table ip natlab``):

- ``"home"``: ``masquerade`` on wan0: endpoint-independent mapping with port
  preservation; a forward chain (policy drop) that lets out LAN->WAN and lets
  in only established/related traffic, and an input chain (policy drop) on
  the WAN side: address-and-port-dependent filtering.
- ``"symmetric"``: the same with ``masquerade fully-random``: a new random
  port for every destination (endpoint-dependent mapping).

``wan_policy="accept"`` builds a router without the drop policies (an open
router, NAT only), which reproduces the lab fact that an unsolicited packet
to the WAN port creates a confirmed, unreplied conntrack entry that shifts
the mapping of the host's next outgoing flow to that peer.

Usage::

    from natlab import natlab  # the fixture (skips where namespaces cannot be made)

    def test_x(natlab, tmp_path):
        pub = natlab.public_host("pub")
        home = natlab.nat_host("home", "home")
        server = pub.daemon(tmp_path / "pub")
        client = home.daemon(tmp_path / "home")
        client.meshctl("nat", "--stun", server.udp_address)

``NatLab`` is a context manager; leaving it (normally, by an exception or by
KeyboardInterrupt) stops every daemon and process it started, closes the
sockets made with ``Host.udp_socket`` and deletes every namespace (the veths
go with them).  Leftovers of labs whose owning process is gone (a run killed
with SIGKILL) are removed when the next lab starts.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshd.testing.localmesh import Daemon

PREFIX = "natlab-"
PUBLIC_PREFIX = "198.51.100."  # TEST-NET-2: the lab's "internet"
PUBLIC_NET = PUBLIC_PREFIX + "0/24"
NAT_KINDS = ("home", "symmetric")
DEFAULT_PORT = 4100

_NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,19}")
_CMD_TIMEOUT = 30.0
_SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")


class NatLabError(RuntimeError):
    """A lab command failed; the message has the command and its stderr."""


# --- low-level helpers ----------------------------------------------------------


def _child_env() -> dict[str, str]:
    """The environment for lab commands: PATH with the sbin folders (ip, nft, conntrack live there)."""
    env = dict(os.environ)
    path = env.get("PATH", "").split(os.pathsep)
    env["PATH"] = os.pathsep.join(path + [d for d in _SBIN if d not in path])
    return env


def _ip(*args: str, check: bool = True, timeout: float = _CMD_TIMEOUT) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check, timeout=timeout)


def _run(cmd: list[str], *, check: bool = True, timeout: float = _CMD_TIMEOUT, input: str | None = None,
         **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("stdin", None if input is not None else subprocess.DEVNULL)
    kwargs.setdefault("env", _child_env())
    proc = subprocess.run(cmd, timeout=timeout, input=input, **kwargs)
    if check and proc.returncode != 0:
        raise NatLabError(f"{' '.join(cmd)} failed ({proc.returncode}): {(proc.stderr or '').strip()}")
    return proc


@functools.cache
def netns_unavailable_reason() -> str | None:
    """None if this machine can create network namespaces, else why not.

    Only a failure to create a namespace (not root, no CAP_SYS_ADMIN, a
    container without /run/netns) counts; missing nft or conntrack is an
    error the lab raises, since ``make test`` installs them.
    """
    if sys.platform != "linux":
        return "the NAT lab needs Linux network namespaces"
    if _which("ip") is None:
        return "the NAT lab needs iproute2 ('ip')"
    probe = f"{PREFIX}{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        proc = _ip("netns", "add", probe, check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run 'ip netns add': {exc}"
    if proc.returncode != 0:
        return f"cannot create network namespaces here ('ip netns add' said: {proc.stderr.strip()})"
    _ip("netns", "del", probe, check=False, timeout=10)
    return None


def _which(name: str) -> str | None:
    for d in os.environ.get("PATH", "").split(os.pathsep) + list(_SBIN):
        path = os.path.join(d, name)
        if os.access(path, os.X_OK):
            return path
    return None


def list_namespaces() -> list[str]:
    """Names of all named network namespaces on this machine."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _kill_namespace(ns: str, deadline: float = 5.0) -> None:
    """SIGKILL every process still inside ``ns``, wait (bounded) for them, delete ``ns``."""
    pids = _netns_pids(ns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    end = time.monotonic() + deadline
    while any(_pid_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.01)
    _ip("netns", "del", ns, check=False)


def cleanup_leftovers() -> list[str]:
    """Delete lab namespaces whose owning process (the PID in the name) is gone.

    Namespaces of labs that are still running (in this or a parallel process)
    are left alone.  Returns the names removed.
    """
    removed = []
    for ns in list_namespaces():
        if not ns.startswith(PREFIX):
            continue
        owner = ns[len(PREFIX):].split("-", 1)[0]
        if owner.isdigit() and _pid_alive(int(owner)):
            continue
        _kill_namespace(ns)
        removed.append(ns)
    return removed


_libc = None


def _setns(fd: int) -> None:
    if hasattr(os, "setns"):  # Python 3.12+
        os.setns(fd, _CLONE_NEWNET)
        return
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def in_namespace(ns: str, func):
    """Call ``func()`` in a short-lived thread that has joined namespace ``ns``.

    setns(CLONE_NEWNET) changes only the calling thread, and the thread ends
    right after, so the rest of the process stays in its namespace.  A socket
    created by ``func`` belongs to ``ns`` for its whole life.
    """
    result: dict = {}

    def target() -> None:
        try:
            fd = os.open(_NETNS_DIR / ns, os.O_RDONLY)
            try:
                _setns(fd)
            finally:
                os.close(fd)
            result["value"] = func()
        except BaseException as exc:  # handed to the caller
            result["error"] = exc

    thread = threading.Thread(target=target, name=f"netns-{ns}", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


# --- daemons ----------------------------------------------------------------------


class NetnsDaemon(Daemon):
    """A :class:`meshd.testing.localmesh.Daemon` whose process runs inside a host's namespace.

    The daemon is started with ``ip netns exec NS python -m cli.meshd_main
    start``; ``ip`` execs the command, so ``proc.pid`` is the daemon itself.
    ``meshctl`` runs in the root namespace: it talks to the daemon over the
    Unix socket in the data directory, which namespaces do not separate.
    """

    def __init__(self, host: "Host", data_dir: Path, *, port: int = DEFAULT_PORT,
                 listen: str | None = None, **kwargs):
        super().__init__(data_dir, listen=listen or f"0.0.0.0:{port}",
                         command_prefix=["ip", "netns", "exec", host.ns], env=_child_env(), **kwargs)
        self.host = host

    @property
    def port(self) -> int:
        return self.address.hostport.port

    @property
    def udp_address(self) -> str:
        """``HOST:PORT`` of the daemon's socket with the host's own address (a STUN server address)."""
        return f"{self.host.address}:{self.port}"

    @property
    def dial_address(self) -> str:
        """``PEERID@HOST:PORT`` with the host's own address (what a bootstrap list holds)."""
        return f"{self.peer_id}@{self.udp_address}"


# --- hosts ------------------------------------------------------------------------


class Host:
    """One namespace of the lab: a public host, a NAT router or a host behind one.

    ``address`` is the host's own IPv4 address (public for public hosts,
    10.K.0.2 behind a NAT, the LAN side 10.K.0.1 for a router);
    ``wan_address`` is the address the public segment sees it as (the
    router's WAN address for a NAT host, ``address`` for a public host).
    """

    def __init__(self, lab: "NatLab", name: str, ns: str, kind: str, address: str, wan_address: str,
                 router: "Host | None" = None):
        self.lab = lab
        self.name = name
        self.ns = ns
        self.kind = kind  # "public", "home", "symmetric" or "router"
        self.address = address
        self.wan_address = wan_address
        self.router = router

    def __repr__(self) -> str:
        return f"<Host {self.name} {self.kind} {self.address} wan {self.wan_address} ns {self.ns}>"

    def command(self, cmd: list[str] | str) -> list[str]:
        """``cmd`` (argv list, or a string for ``sh -c``) prefixed to run inside this namespace."""
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        return ["ip", "netns", "exec", self.ns, *argv]

    def run(self, cmd: list[str] | str, *, check: bool = True, timeout: float = _CMD_TIMEOUT,
            **kwargs) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside the namespace and wait (text output captured by default).

        NatLabError (with stderr) if it exits non-zero and ``check`` is true.
        """
        return _run(self.command(cmd), check=check, timeout=timeout, **kwargs)

    def popen(self, cmd: list[str] | str, **kwargs) -> subprocess.Popen:
        """Start ``cmd`` inside the namespace; the lab kills it at teardown."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        kwargs.setdefault("env", _child_env())
        proc = subprocess.Popen(self.command(cmd), **kwargs)
        self.lab._procs.append(proc)
        return proc

    def socket(self, family: int = socket.AF_INET, type: int = socket.SOCK_DGRAM) -> socket.socket:
        """A socket of this test process that lives in this namespace; closed at teardown."""
        sock = in_namespace(self.ns, lambda: socket.socket(family, type))
        self.lab._sockets.append(sock)
        return sock

    def udp_socket(self, port: int = 0, *, timeout: float = 5.0) -> socket.socket:
        """A UDP socket bound to 0.0.0.0:``port`` in this namespace, with a receive timeout."""
        sock = self.socket()
        sock.bind(("0.0.0.0", port))
        sock.settimeout(timeout)
        return sock

    def daemon(self, data_dir: Path, *, port: int = DEFAULT_PORT, start: bool = True,
               timeout: float = 30.0, **kwargs) -> NetnsDaemon:
        """A meshd daemon in this namespace listening on 0.0.0.0:``port`` (started unless ``start=False``).

        ``kwargs`` go to :class:`meshd.testing.localmesh.Daemon` (``bootstrap``,
        ``config``, ``listen``).  The lab stops it at teardown.
        """
        daemon = NetnsDaemon(self, Path(data_dir), port=port, **kwargs)
        self.lab._daemons.append(daemon)
        return daemon.start(timeout) if start else daemon

    def block_packet_too_big(self) -> None:
        """Drop the ICMP "fragmentation needed" / ICMPv6 "packet too big" this namespace
        sends (nftables, ``table inet natlab_pmtu``): a router that does this makes a
        path-MTU black hole, where a packet too large for a link just disappears."""
        self.run(["nft", "-f", "-"], input="""
table inet natlab_pmtu {
    chain output {
        type filter hook output priority filter; policy accept;
        icmp type destination-unreachable icmp code frag-needed counter drop
        icmpv6 type packet-too-big counter drop
    }
}
""")

    def link_mtu(self, device: str) -> int:
        """The MTU of ``device`` in this namespace."""
        out = self.run(["ip", "-j", "link", "show", "dev", device]).stdout
        return int(json.loads(out)[0]["mtu"])

    # --- router views (for NAT hosts; on a router they read its own tables) ---

    def _router(self) -> "Host":
        router = self if self.kind == "router" else self.router
        if router is None:
            raise NatLabError(f"{self.name} is a public host: it has no router")
        return router

    def wan_drops(self) -> int:
        """Packets the router dropped on its WAN side so far (input and forward chains)."""
        out = self._router().run(["nft", "-j", "list", "counters", "table", "ip", "natlab"]).stdout
        return sum(item["counter"]["packets"] for item in json.loads(out)["nftables"] if "counter" in item)

    def conntrack(self, *args: str) -> list[str]:
        """The router's conntrack entries (``conntrack -L ARGS``), one line each."""
        out = self._router().run(["conntrack", "-L", *args], check=False)
        if out.returncode != 0:
            raise NatLabError(f"conntrack -L in {self.name}'s router: {out.stderr.strip()}")
        return [line for line in out.stdout.splitlines() if line.strip()]


# --- the lab ----------------------------------------------------------------------


def _ruleset(kind: str, wan_policy: str) -> str:
    masquerade = "masquerade fully-random" if kind == "symmetric" else "masquerade"
    drop = wan_policy == "drop"
    policy = "drop" if drop else "accept"
    return f"""
table ip natlab {{
    counter wan_in_drop {{ }}
    counter wan_fwd_drop {{ }}
    chain prerouting {{
        type nat hook prerouting priority dstnat; policy accept;
    }}
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan0" {masquerade}
    }}
    chain forward {{
        type filter hook forward priority filter; policy {policy};
        ct state established,related accept
        iifname "lan0" oifname "wan0" accept
        {'iifname "wan0" counter name "wan_fwd_drop" drop' if drop else ''}
    }}
    chain input {{
        type filter hook input priority filter; policy {policy};
        iifname "lo" accept
        iifname "lan0" accept
        ct state established,related accept
        {'iifname "wan0" counter name "wan_in_drop" drop' if drop else ''}
    }}
}}
"""


class NatLab:
    """The lab: a public segment, public hosts and hosts behind NAT routers.

    Use as a context manager (or call :meth:`close`); all names carry this
    process's PID and a random tag, so labs in parallel processes never clash.
    """

    def __init__(self):
        self.tag = f"{os.getpid()}-{secrets.token_hex(2)}"
        self.namespaces: list[str] = []  # every namespace created, in order
        self.hosts: dict[str, Host] = {}
        self.routers: list[Host] = []
        self._procs: list[subprocess.Popen] = []
        self._daemons: list[NetnsDaemon] = []
        self._sockets: list[socket.socket] = []
        self._next_public = 10
        self._next_lan = 1
        self._open = False
        self.inet: str | None = None

    # --- life cycle ---

    def __enter__(self) -> "NatLab":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> "NatLab":
        """Remove leftovers of dead labs, check the tools, build the public segment."""
        for tool, package in (("nft", "nftables"), ("conntrack", "conntrack")):
            if _which(tool) is None:
                raise NatLabError(f"'{tool}' is not installed (Debian package {package}; make test installs it)")
        cleanup_leftovers()
        self._open = True
        atexit.register(self.close)
        try:
            self.inet = self._add_namespace("_inet")  # "_" never occurs in host names
            _ip("-n", self.inet, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.inet, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop daemons and processes, close sockets, delete every namespace. Idempotent, never raises."""
        if not self._open:
            return
        self._open = False
        atexit.unregister(self.close)
        errors = []
        for daemon in self._daemons:  # SIGTERM all first, so they shut down in parallel
            if daemon.running:
                try:
                    daemon.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for daemon in self._daemons:
            try:
                daemon.stop(timeout=5)
            except Exception as exc:  # keep tearing down
                errors.append(exc)
        for proc in self._procs:
            try:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(5)
            except Exception as exc:
                errors.append(exc)
        for sock in self._sockets:
            sock.close()  # a socket keeps its namespace alive after the name is gone
        for ns in reversed(self.namespaces):
            try:
                _kill_namespace(ns)
            except Exception as exc:
                errors.append(exc)
        left = set(self.namespaces) & set(list_namespaces())
        if left or errors:
            print(f"natlab teardown: left {sorted(left)}, errors {errors!r}", file=sys.stderr)

    # --- building ---

    def _add_namespace(self, role: str) -> str:
        ns = f"{PREFIX}{self.tag}-{role}"
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def _check_name(self, name: str) -> None:
        if not self._open:
            raise NatLabError("the lab is not open (use it as a context manager)")
        if not _NAME_RE.fullmatch(name):
            raise NatLabError(f"host name {name!r}: use 1-20 of a-z, 0-9 and '-'")
        if name in self.hosts:
            raise NatLabError(f"host name {name!r} is already used in this lab")

    def _attach_public(self, ns: str, mtu: int | None = None) -> str:
        """Connect ``ns`` to the public segment (wan0); returns its public address.

        ``mtu`` sets wan0 and its bridge port (default: the kernel's 1500).
        """
        if self._next_public > 250:
            raise NatLabError("the public segment is full")
        address = f"{PUBLIC_PREFIX}{self._next_public}"
        port = f"p{self._next_public}"
        self._next_public += 1
        _ip("-n", ns, "link", "add", "wan0", "type", "veth", "peer", "name", port, "netns", self.inet)
        if mtu is not None:
            _ip("-n", ns, "link", "set", "wan0", "mtu", str(mtu))
            _ip("-n", self.inet, "link", "set", port, "mtu", str(mtu))
        _ip("-n", self.inet, "link", "set", port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "wan0")
        _ip("-n", ns, "link", "set", "wan0", "up")
        return address

    def public_host(self, name: str, *, mtu: int | None = None) -> Host:
        """A namespace on the public segment with one address in 198.51.100.0/24 (no NAT).

        ``mtu``: of its link to the segment (both ends of the veth); the
        bridge drops frames too large for the port they leave by, without ICMP.
        """
        self._check_name(name)
        ns = self._add_namespace(name)
        address = self._attach_public(ns, mtu)
        host = Host(self, name, ns, "public", address, address)
        self.hosts[name] = host
        return host

    def nat_host(self, name: str, kind: str = "home", *, wan_policy: str = "drop",
                 mtu: int | None = None, wan_mtu: int | None = None) -> Host:
        """A host 10.K.0.2 behind its own NAT router of ``kind`` ("home" or "symmetric").

        The router ``host.router`` has wan0 on the public segment and lan0
        10.K.0.1/24; ip_forward is on in the router namespace only.
        ``wan_policy="accept"`` leaves out the drop policies (see the module doc).
        ``mtu`` is the LAN link's (eth0 and lan0), ``wan_mtu`` the router's
        link to the public segment (default: the kernel's 1500 for both); a
        router forwarding a packet larger than ``wan_mtu`` with DF set drops it
        and sends ICMP "fragmentation needed" (see ``Host.block_packet_too_big``).
        """
        if kind not in NAT_KINDS:
            raise NatLabError(f"NAT kind {kind!r}: choose one of {NAT_KINDS}")
        if wan_policy not in ("drop", "accept"):
            raise NatLabError(f"wan_policy {wan_policy!r}: 'drop' or 'accept'")
        self._check_name(name)
        if self._next_lan > 250:
            raise NatLabError("no LAN prefixes left")
        k = self._next_lan
        self._next_lan += 1
        router_ns = self._add_namespace(f"{name}_rt")
        host_ns = self._add_namespace(name)
        wan = self._attach_public(router_ns, wan_mtu)
        lan_gw, lan_host = f"10.{k}.0.1", f"10.{k}.0.2"
        _ip("-n", host_ns, "link", "add", "eth0", "type", "veth", "peer", "name", "lan0", "netns", router_ns)
        if mtu is not None:
            _ip("-n", host_ns, "link", "set", "eth0", "mtu", str(mtu))
            _ip("-n", router_ns, "link", "set", "lan0", "mtu", str(mtu))
        _ip("-n", router_ns, "addr", "add", f"{lan_gw}/24", "dev", "lan0")
        _ip("-n", router_ns, "link", "set", "lan0", "up")
        _ip("-n", host_ns, "addr", "add", f"{lan_host}/24", "dev", "eth0")
        _ip("-n", host_ns, "link", "set", "eth0", "up")
        _ip("-n", host_ns, "route", "add", "default", "via", lan_gw)
        router = Host(self, f"{name}_rt", router_ns, "router", lan_gw, wan)
        router.run(["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        router.run(["nft", "-f", "-"], input=_ruleset(kind, wan_policy))
        host = Host(self, name, host_ns, kind, lan_host, wan, router=router)
        self.routers.append(router)
        self.hosts[name] = host
        return host

    def site(self, name: str, hosts: tuple[str, ...] = ("a", "b"), kind: str = "home") -> list[Host]:
        """Several hosts on one LAN behind one NAT router of ``kind`` (an office, a lab, a home).

        The router ``{name}_rt`` has wan0 on the public segment and a bridge
        lan0 10.K.0.1/24 (the LAN switch); host i is 10.K.0.(i+2) on eth0,
        default via 10.K.0.1.  The hosts reach each other across the bridge
        (multicast too) and the internet through the router's NAT, which does
        not hairpin: a packet to the router's WAN address from inside is not
        turned back in.  Returns the hosts in the order named.
        """
        if kind not in NAT_KINDS:
            raise NatLabError(f"NAT kind {kind!r}: choose one of {NAT_KINDS}")
        self._check_name(name)
        for host_name in hosts:
            self._check_name(host_name)
        if self._next_lan > 250:
            raise NatLabError("no LAN prefixes left")
        k = self._next_lan
        self._next_lan += 1
        router_ns = self._add_namespace(f"{name}_rt")
        wan = self._attach_public(router_ns)
        lan_gw = f"10.{k}.0.1"
        _ip("-n", router_ns, "link", "add", "lan0", "type", "bridge")
        _ip("-n", router_ns, "addr", "add", f"{lan_gw}/24", "dev", "lan0")
        _ip("-n", router_ns, "link", "set", "lan0", "up")
        router = Host(self, f"{name}_rt", router_ns, "router", lan_gw, wan)
        router.run(["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        # a plain switch: where br_netfilter is loaded (docker does), bridged frames
        # would otherwise meet the router's forward chain and its drop policy
        router.run(["sysctl", "-q", "-e", "-w", "net.bridge.bridge-nf-call-iptables=0",
                    "net.bridge.bridge-nf-call-ip6tables=0", "net.bridge.bridge-nf-call-arptables=0"])
        router.run(["nft", "-f", "-"], input=_ruleset(kind, "drop"))
        self.routers.append(router)
        members = []
        for i, host_name in enumerate(hosts):
            host_ns = self._add_namespace(host_name)
            address, port = f"10.{k}.0.{i + 2}", f"{name[:8]}{i}"
            _ip("-n", host_ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", router_ns)
            _ip("-n", router_ns, "link", "set", port, "master", "lan0", "up")
            _ip("-n", host_ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", host_ns, "link", "set", "eth0", "up")
            _ip("-n", host_ns, "route", "add", "default", "via", lan_gw)
            host = Host(self, host_name, host_ns, kind, address, wan, router=router)
            self.hosts[host_name] = host
            members.append(host)
        return members

    # --- between tests ---

    def flush_conntrack(self) -> None:
        """Forget every NAT mapping and connection state in all routers."""
        for router in self.routers:
            router.run(["conntrack", "-F"])

    @property
    def daemons(self) -> list[NetnsDaemon]:
        return list(self._daemons)

    @property
    def processes(self) -> list[subprocess.Popen]:
        """Processes started with ``Host.popen`` (daemons are in ``daemons``)."""
        return list(self._procs)


# --- pytest ----------------------------------------------------------------------


def require_netns() -> None:
    """pytest.skip with the reason when this machine cannot create network namespaces."""
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(f"NAT lab unavailable: {reason}")


@pytest.fixture
def natlab():
    """A fresh :class:`NatLab` for one test, torn down whatever happens."""
    require_netns()
    with NatLab() as lab:
        yield lab


__all__ = [
    "NAT_KINDS", "PUBLIC_NET", "Host", "NatLab", "NatLabError", "NetnsDaemon", "cleanup_leftovers",
    "in_namespace", "list_namespaces", "natlab", "netns_unavailable_reason", "require_netns",
]
