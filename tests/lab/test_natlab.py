"""The NAT lab itself: topology, NAT mapping and filtering as seen from outside, teardown.

Every test builds its own lab (namespaces, nftables routers, real meshd
daemons) with the ``natlab`` fixture and leaves nothing behind.  Traffic
stays inside the lab's namespaces.  A packet the lab should drop is
confirmed dropped by the router's drop counter (polled with a bound), and
only then is the receiver checked to have nothing, with a short timeout:
absence cannot be waited for by an event.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess

import pytest

from meshd.testing.localmesh import wait_until
from nat.stun import binding_request, decode
from natlab import NatLab, list_namespaces, natlab, require_netns  # noqa: F401 (natlab: the fixture)

NOTHING = 0.2  # seconds a receiver listens for a packet that must not come


def assert_nothing_arrives(sock: socket.socket) -> None:
    sock.settimeout(NOTHING)
    try:
        data, source = sock.recvfrom(2048)
    except TimeoutError:
        return
    finally:
        sock.settimeout(5.0)
    raise AssertionError(f"{data!r} from {source} was delivered, the NAT should have dropped it")


def send_dropped(nat_host, sender: socket.socket, dest: tuple[str, int], receiver: socket.socket) -> None:
    """Send from ``sender`` to ``dest``; the router behind ``dest`` drops it, ``receiver`` gets nothing."""
    before = nat_host.wan_drops()
    sender.sendto(b"unsolicited", dest)
    wait_until(lambda: nat_host.wan_drops() > before, 5, f"{nat_host.name}'s router to drop a packet to {dest}")
    assert_nothing_arrives(receiver)


def stun_mapped(sock: socket.socket, server: tuple[str, int]) -> tuple[str, int]:
    """One STUN Binding transaction from ``sock``: our address as ``server`` sees it."""
    request = binding_request()
    for _ in range(3):  # the lab does not lose packets; retry only to be safe
        sock.sendto(request.encode(), server)
        try:
            data, source = sock.recvfrom(2048)
        except TimeoutError:
            continue
        reply = decode(data)
        assert source == server and reply.transaction_id == request.transaction_id
        return reply.xor_mapped_address
    raise AssertionError(f"no STUN answer from {server}")


# --- topology -----------------------------------------------------------------------


def test_nat_host_reaches_the_internet_but_not_the_reverse(natlab):
    pub = natlab.public_host("pub")
    home = natlab.nat_host("home", "home")
    assert pub.address.startswith("198.51.100.") and pub.wan_address == pub.address
    assert home.address == "10.1.0.2" and home.router.address == "10.1.0.1"
    assert home.wan_address.startswith("198.51.100.") and home.wan_address != pub.address

    server = pub.udp_socket(7000)
    client = home.udp_socket(7001)
    client.sendto(b"ping", (pub.address, 7000))
    data, seen_as = server.recvfrom(100)
    assert data == b"ping" and seen_as == (home.wan_address, 7001)  # NATed, port preserved
    server.sendto(b"pong", seen_as)
    assert client.recvfrom(100) == (b"pong", (pub.address, 7000))

    # the private address is not routed on the public segment at all
    with pytest.raises(OSError) as unreachable:
        server.sendto(b"hello", (home.address, 7001))
    assert unreachable.value.errno == errno.ENETUNREACH

    # ... and with a route through the router, its forward chain drops new inbound flows
    pub.run(["ip", "route", "add", "10.1.0.0/24", "via", home.wan_address])
    listener = home.udp_socket(7002)
    send_dropped(home, server, (home.address, 7002), listener)
    # a port on the WAN address that nothing inside has used is closed too
    send_dropped(home, server, (home.wan_address, 7002), listener)

    # the router itself stays out of the root namespace's way: ip_forward only inside
    assert home.router.run(["sysctl", "-n", "net.ipv4.ip_forward"]).stdout.strip() == "1"
    assert pub.run(["sysctl", "-n", "net.ipv4.ip_forward"]).stdout.strip() == "0"


# --- mapping (STUN through real daemons) --------------------------------------------


def test_stun_sees_endpoint_independent_home_and_endpoint_dependent_symmetric_mapping(natlab, tmp_path):
    servers = [natlab.public_host(f"stun{i}").daemon(tmp_path / f"stun{i}") for i in (1, 2)]
    home = natlab.nat_host("home", "home")
    sym = natlab.nat_host("sym", "symmetric")

    def reflexive(host) -> dict[str, str]:
        daemon = host.daemon(tmp_path / host.name)
        for server in servers:
            daemon.meshctl("nat", "--stun", server.udp_address, timeout=20)
        return daemon.meshctl("nat")["reflexive"]

    seen = reflexive(home)
    assert set(seen) == {s.udp_address for s in servers}
    # one mapping for every destination, on the router's address, with the port kept
    assert set(seen.values()) == {f"{home.wan_address}:4100"}

    seen = reflexive(sym)
    hosts = {value.rsplit(":", 1)[0] for value in seen.values()}
    ports = {value.rsplit(":", 1)[1] for value in seen.values()}
    assert hosts == {sym.wan_address}
    assert len(ports) == 2, f"a symmetric NAT maps each destination to its own port: {seen}"

    # the public daemons answered one Binding request each from each NAT host
    for server in servers:
        assert server.meshctl("nat")["stun_answered"] == 2


# --- filtering ----------------------------------------------------------------------


def test_home_nat_filters_by_address_and_port(natlab, tmp_path):
    stun_host, other = natlab.public_host("stun"), natlab.public_host("other")
    stun = stun_host.daemon(tmp_path / "stun")
    home = natlab.nat_host("home", "home")

    inside = home.udp_socket(5000)
    mapped = stun_mapped(inside, (stun_host.address, stun.port))
    assert mapped == (home.wan_address, 5000)

    # strangers are dropped: another host, and another port of the STUN server's host
    stranger = other.udp_socket(6000)
    send_dropped(home, stranger, mapped, inside)
    same_host_other_port = stun_host.udp_socket(6001)
    send_dropped(home, same_host_other_port, mapped, inside)

    # the server the host talked to still reaches it through the same mapping
    assert stun_mapped(inside, (stun_host.address, stun.port)) == mapped

    # once the host has sent to the stranger, the stranger gets in, and sees the same mapping
    inside.sendto(b"hello", (other.address, 6000))
    data, seen_as = stranger.recvfrom(100)
    assert (data, seen_as) == (b"hello", mapped)
    stranger.sendto(b"welcome", mapped)
    assert inside.recvfrom(100) == (b"welcome", (other.address, 6000))

    # flushing conntrack forgets the permissions: the stranger is a stranger again
    natlab.flush_conntrack()
    send_dropped(home, stranger, mapped, inside)


def test_symmetric_nat_filters_too_and_maps_per_destination(natlab):
    a, b = natlab.public_host("a"), natlab.public_host("b")
    sym = natlab.nat_host("sym", "symmetric")
    to_a, to_b = a.udp_socket(5000), b.udp_socket(5000)
    inside = sym.udp_socket(5000)

    inside.sendto(b"1", (a.address, 5000))
    inside.sendto(b"2", (b.address, 5000))
    (_, via_a), (_, via_b) = to_a.recvfrom(10), to_b.recvfrom(10)
    assert via_a[0] == via_b[0] == sym.wan_address and via_a[1] != via_b[1]

    # b may answer on its own mapping but not use a's
    send_dropped(sym, to_b, via_a, inside)
    to_b.sendto(b"reply", via_b)
    assert inside.recvfrom(10) == (b"reply", (b.address, 5000))


# --- the lab fact about punching through a router without a WAN drop policy -------


@pytest.mark.parametrize("wan_policy, shifted", [("drop", False), ("accept", True)])
def test_an_early_inbound_packet_shifts_the_mapping_only_without_a_drop_policy(natlab, wan_policy, shifted):
    """The first punch packet of a peer reaches the router before the host's own.

    With the drop policy it leaves no conntrack entry and the host's packet
    keeps its port; an open router confirms an unreplied entry for it, so
    the host's own flow to that peer clashes and is mapped to another port.
    """
    peer_host = natlab.public_host("peer")
    home = natlab.nat_host("home", "home", wan_policy=wan_policy)
    peer = peer_host.udp_socket(5000)
    inside = home.udp_socket(4100)

    peer.sendto(b"punch", (home.wan_address, 4100))
    if wan_policy == "drop":
        wait_until(lambda: home.wan_drops() == 1, 5, "the router to drop the early punch")
        assert home.conntrack("-p", "udp") == []
    else:
        wait_until(lambda: home.conntrack("-p", "udp", "--orig-src", peer_host.address), 5,
                 "the early punch's conntrack entry")

    inside.sendto(b"punch back", (peer_host.address, 5000))
    data, seen_as = peer.recvfrom(100)
    assert seen_as[0] == home.wan_address
    assert (seen_as[1] != 4100) is shifted, f"mapped to {seen_as} with wan_policy={wan_policy}"


# --- teardown -----------------------------------------------------------------------


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("error", [None, RuntimeError, KeyboardInterrupt])
def test_teardown_removes_namespaces_processes_and_sockets(tmp_path, error):
    require_netns()
    links = _root_links()

    class Boom(Exception):
        pass

    raised = error or Boom
    with pytest.raises(raised):
        with NatLab() as lab:
            pub = lab.public_host("pub")
            home = lab.nat_host("home", "home")
            sym = lab.nat_host("sym", "symmetric")
            daemons = [pub.daemon(tmp_path / "pub"), home.daemon(tmp_path / "home")]
            sleeper = sym.popen(["sleep", "300"])
            sock = home.udp_socket()
            namespaces = list(lab.namespaces)
            assert len(namespaces) == 6 and set(namespaces) <= set(list_namespaces())
            pids = [d.proc.pid for d in daemons] + [sleeper.pid]
            assert all(_alive(pid) for pid in pids)
            raise raised("inside the lab")

    assert not set(namespaces) & set(list_namespaces())
    assert not any(_alive(pid) for pid in pids)
    assert all(not d.running for d in daemons) and sleeper.poll() is not None
    assert sock.fileno() == -1
    assert _root_links() == links  # nothing was ever created in the root namespace
    lab.close()  # idempotent


def test_leftovers_of_dead_labs_are_removed_and_live_ones_kept():
    require_netns()
    dead = _dead_pid()
    leftover = f"natlab-{dead}-dead-_inet"
    live = f"natlab-{os.getpid()}-live-_inet"  # this process is alive: another lab's, keep it
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    subprocess.run(["ip", "netns", "add", live], check=True)
    stray = subprocess.Popen(["ip", "netns", "exec", leftover, "sleep", "300"])
    try:
        wait_until(lambda: str(stray.pid) in subprocess.run(["ip", "netns", "pids", leftover],
                                                         capture_output=True, text=True).stdout.split(),
                 5, "the stray process to enter the leftover namespace")
        with NatLab():
            names = list_namespaces()
            assert leftover not in names and live in names
            assert stray.wait(5) == -9
    finally:
        stray.kill()
        stray.wait(5)
        for ns in (leftover, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid
