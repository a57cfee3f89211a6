"""meshctl doctor's verdicts, from what a daemon would report."""

import os

from cli.commands.doctor import (CLOCK_SKEW_FAIL, check_bootstrap, check_clock, check_peers, check_port_mapping,
                                 check_ports, check_private, check_reachability)

A, B = "a" * 56, "b" * 56  # peer ids


def test_peers_no_connection_fails_relayed_only_warns_direct_is_ok():
    assert check_peers({"known_peers": 0}, []).verdict == "fail"
    assert "meshd start --bootstrap" in check_peers({"known_peers": 0}, []).fix
    assert "did not answer" in check_peers({"known_peers": 3}, []).fix
    assert check_peers({}, [{"path": "relayed"}]).verdict == "warn"
    ok = check_peers({}, [{"path": "direct"}, {"path": "relayed"}, {"path": "direct"}])
    assert ok.verdict == "ok" and ok.detail == "3 connected: 2 direct, 1 relayed"


def test_reachability_public_or_relayed_is_ok_private_without_a_relay_warns():
    assert check_reachability({"reachability": "public", "reachability_address": "1.2.3.4:4100"}).verdict == "ok"
    relayed = {"reachability": "private", "mapping": "endpoint-independent", "relay_reservations": {"r": 60}}
    assert check_reachability(relayed).verdict == "ok"
    assert check_reachability({**relayed, "relay_reservations": {}}).verdict == "warn"
    assert check_reachability({"reachability": "unknown"}).verdict == "warn"


def test_port_mapping_is_only_missed_behind_a_nat():
    assert check_port_mapping({"port_mapping": {"external": "1.2.3.4:4100", "gateway": "10.0.0.1"}}).verdict == "ok"
    assert check_port_mapping({"reachability": "public"}).verdict == "ok"
    assert check_port_mapping({"listen": "127.0.0.1:4100", "reachability": "unknown"}).verdict == "ok"
    assert check_port_mapping({"listen": "0.0.0.0:4100", "reachability": "private"}).verdict == "warn"


def test_clock_fails_beyond_what_records_tolerate():
    assert check_clock({}).verdict == "warn"
    assert check_clock({"a" * 56: 0.2}).verdict == "ok"
    assert check_clock({"a" * 56: 0.2, "b" * 56: -10.0}).verdict == "warn"
    failed = check_clock({"a" * 56: CLOCK_SKEW_FAIL + 1})
    assert failed.verdict == "fail" and "NTP" in failed.fix


def test_a_data_folder_others_can_read_fails(tmp_path):
    os.chmod(tmp_path, 0o700)
    assert check_private(tmp_path).verdict == "ok"
    os.chmod(tmp_path, 0o755)
    failed = check_private(tmp_path)
    assert failed.verdict == "fail" and failed.fix == f"chmod 700 {tmp_path}"


def test_bootstrap_is_a_line_per_peer_unreachable_fails_only_if_none_is_reached():
    assert [(c.verdict, c.detail) for c in check_bootstrap({}, {})] == [("ok", "none configured")]
    dials = {f"{A}@10.0.0.1:4100": None, f"{B}@10.0.0.2:4100": "UNAVAILABLE: handshake timed out"}
    up, down = check_bootstrap(dials, {A: "direct"})
    assert (up.name, up.verdict, up.detail) == ("bootstrap", "ok", "aaaaaaaaaa...@10.0.0.1:4100 connected (direct)")
    assert down.verdict == "warn" and down.detail.endswith("unreachable: UNAVAILABLE: handshake timed out")
    assert "10.0.0.2:4100" in down.fix
    [alone] = check_bootstrap({f"{B}@10.0.0.2:4100": "UNAVAILABLE: handshake timed out"}, {})
    assert alone.verdict == "fail" and "10.0.0.2:4100" in alone.fix


def test_ports_lists_the_udp_port_and_each_lane_and_fails_on_a_lane_not_listening():
    status = {"listen": "0.0.0.0:4100", "transport": {"sent": 1}, "shards": {"models": 0, "lane": 41000},
              "learning": {"groups": 0, "lane": "off"}, "crdt": "off"}
    ok = check_ports(status)
    assert (ok.name, ok.verdict) == ("ports", "ok")
    assert ok.detail == "UDP 0.0.0.0:4100 (QUIC), TCP 0.0.0.0:41000 (shards lane)"
    failed = check_ports({**status, "learning": {"groups": 0, "lane": None}})
    assert failed.verdict == "fail" and failed.detail.startswith("not listening: learning lane")
    loopback = check_ports({**status, "listen": "127.0.0.1:4100"})
    assert loopback.verdict == "warn" and "0.0.0.0:4100" in loopback.fix
