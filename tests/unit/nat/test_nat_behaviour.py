"""NAT mapping classification from STUN observations."""

from nat.behaviour import Mapping, classify_mapping

LOCAL = ("10.0.0.2", 4100)
S1, S2, S3 = ("198.51.100.1", 3478), ("198.51.100.2", 3478), ("198.51.100.1", 3479)


def test_no_nat_when_every_server_sees_our_own_address():
    report = classify_mapping(("198.51.100.9", 4100), [(S1, ("198.51.100.9", 4100)), (S2, ("198.51.100.9", 4100))])
    assert report.mapping == Mapping.NO_NAT
    assert report.port_preserved and report.hole_punching_works


def test_home_router_maps_endpoint_independently():
    seen = ("203.0.113.5", 4100)
    report = classify_mapping(LOCAL, [(S1, seen), (S2, seen)])
    assert report.mapping == Mapping.ENDPOINT_INDEPENDENT
    assert report.public_addresses == (seen,)
    assert report.port_preserved is True
    assert report.hole_punching_works is True


def test_symmetric_nat_across_two_ips_is_endpoint_dependent():
    report = classify_mapping(LOCAL, [(S1, ("203.0.113.5", 50001)), (S2, ("203.0.113.5", 50002))])
    assert report.mapping == Mapping.ENDPOINT_DEPENDENT
    assert report.port_preserved is False
    assert report.hole_punching_works is False
    assert len(report.public_addresses) == 2


def test_two_ports_on_one_server_ip_separate_adm_from_apdm():
    adm = classify_mapping(LOCAL, [(S1, ("203.0.113.5", 5)), (S3, ("203.0.113.5", 5)), (S2, ("203.0.113.5", 6))])
    assert adm.mapping == Mapping.ADDRESS_DEPENDENT
    apdm = classify_mapping(LOCAL, [(S1, ("203.0.113.5", 5)), (S3, ("203.0.113.5", 7)), (S2, ("203.0.113.5", 6))])
    assert apdm.mapping == Mapping.ADDRESS_AND_PORT_DEPENDENT


def test_one_answer_is_not_enough_and_wildcards_are_never_no_nat():
    assert classify_mapping(LOCAL, [(S1, ("203.0.113.5", 4100))]).mapping == Mapping.UNKNOWN
    assert classify_mapping(LOCAL, []).port_preserved is None
    wildcard = classify_mapping(("0.0.0.0", 4100), [(S1, ("198.51.100.9", 4100)), (S2, ("198.51.100.9", 4100))])
    assert wildcard.mapping == Mapping.ENDPOINT_INDEPENDENT
