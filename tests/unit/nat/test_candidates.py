"""Host candidates (nat.candidates): what we offer, what we take from a peer, what we dial."""

import pytest

from nat.candidates import (MAX_HOST_CANDIDATES, dialable, host_candidates, ip_literal, is_site_local,
                            take_candidates)
from nat.errors import Malformed


def test_offer_private_addresses_first_with_our_port_and_never_loopback_or_link_local():
    local = ["127.0.0.1", "198.51.100.7", "10.1.0.2", "::1", "fe80::1", "fd00::2", "169.254.3.3", "192.168.1.5"]
    assert host_candidates(local, 4100) == ["10.1.0.2:4100", "192.168.1.5:4100", "198.51.100.7:4100"]
    assert host_candidates(local, 4100, ipv6=True) == [
        "10.1.0.2:4100", "[fd00::2]:4100", "192.168.1.5:4100", "198.51.100.7:4100"]
    assert host_candidates(local, 4100, ipv4=False, ipv6=True) == ["[fd00::2]:4100"]


def test_offer_is_capped_without_repeats_and_skips_what_is_not_an_address():
    local = ["10.0.0.1", "10.0.0.1", "eth0", "", "0.0.0.0", "224.0.0.251"] + [f"10.0.1.{i}" for i in range(9)]
    offered = host_candidates(local, 1)
    assert offered == ["10.0.0.1:1", "10.0.1.0:1", "10.0.1.1:1", "10.0.1.2:1"]
    assert len(offered) == MAX_HOST_CANDIDATES


@pytest.mark.parametrize("host", ["10.1.0.3", "192.168.0.2", "198.51.100.1", "fd00::5", "2001:db8::1"])
def test_unicast_hosts_are_dialable(host):
    assert dialable(host, loopback=False) and dialable(host, loopback=True)


@pytest.mark.parametrize("host", ["example.com", "localhost", "", "0.0.0.0", "::", "255.255.255.255",
                                  "224.0.0.251", "239.255.77.77", "ff02::1", "10.0.0.1/8"])
def test_names_and_non_unicast_addresses_are_never_dialed(host):
    assert not dialable(host, loopback=False) and not dialable(host, loopback=True)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.8.8", "::1", "fe80::1", "169.254.1.1", "::ffff:127.0.0.1"])
def test_loopback_and_link_local_only_when_we_are_on_loopback(host):
    assert not dialable(host, loopback=False)
    assert dialable(host, loopback=True)


def test_take_candidates_reads_the_local_field_capped():
    texts = [f"10.0.0.{i}:4100" for i in range(10)]
    assert take_candidates({"addrs": [], "local": texts}) == texts[:MAX_HOST_CANDIDATES]
    assert take_candidates({"local": texts[:4] + [None]}) == texts[:4]  # past the cap is not read
    assert take_candidates({"addrs": ["1.2.3.4:5"]}) == []  # a peer that offers none (an older one)
    assert take_candidates({"local": None}) == [] and take_candidates(None) == []


@pytest.mark.parametrize("message", [{"local": "10.0.0.1:1"}, {"local": {"a": 1}}, {"local": [1]},
                                     {"local": [b"10.0.0.1:1"]}, {"local": ["10.0.0.1:1", None]}])
def test_take_candidates_refuses_a_malformed_field(message):
    with pytest.raises(Malformed):
        take_candidates(message)


def test_site_local_is_rfc1918_and_unique_local_only():
    for ip in ("10.9.9.9", "172.16.0.1", "172.31.255.254", "192.168.7.7", "fd12::1", "::ffff:10.0.0.1"):
        assert is_site_local(ip)
    for ip in ("172.32.0.1", "198.51.100.10", "192.0.2.2", "100.64.0.1", "127.0.0.1", "fe80::1", "8.8.8.8",
               "2001:db8::1", "not an ip"):
        assert not is_site_local(ip)


def test_ip_literal_unwraps_ipv4_mapped_addresses():
    assert str(ip_literal("::ffff:10.0.0.1")) == "10.0.0.1"
    assert ip_literal("host.lan") is None
