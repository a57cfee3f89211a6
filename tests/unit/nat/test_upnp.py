"""UPnP-IGD client core: SSDP answers, device descriptions, SOAP, and what a hostile gateway sends.

The files in ``data/`` were captured from miniupnpd 2.3.1 in the NAT lab.
"""

from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from nat import minihttp, safexml, upnp
from nat.errors import Malformed

DATA = Path(__file__).parent / "data"
GATEWAY = "10.1.0.1"
LOCATION = minihttp.Url(GATEWAY, 5000, "/rootDesc.xml")
V2 = upnp.Service(upnp.WAN_IP_2, minihttp.Url(GATEWAY, 5000, "/ctl/IPConn"))


def captured(name: str) -> bytes:
    return (DATA / f"miniupnpd-2.3.1-{name}").read_bytes()


def ssdp_answer(location=f"http://{GATEWAY}:5000/rootDesc.xml", st=upnp.WAN_IP_2, status="HTTP/1.1 200 OK") -> bytes:
    return (f"{status}\r\nCACHE-CONTROL: max-age=120\r\nST: {st}\r\nUSN: uuid:x::{st}\r\nEXT:\r\n"
            f"SERVER: Debian UPnP/1.1 MiniUPnPd/2.3.1\r\nLOCATION: {location}\r\n\r\n").encode()


def description(*services: tuple[str, str], base: str | None = None) -> bytes:
    listed = "".join(f"<service><serviceType>{kind}</serviceType><controlURL>{url}</controlURL></service>"
                     for kind, url in services)
    url_base = f"<URLBase>{base}</URLBase>" if base else ""
    return (f'<?xml version="1.0"?><root xmlns="urn:schemas-upnp-org:device-1-0">{url_base}<device>'
            f"<deviceList><device><deviceList><device><serviceList>{listed}</serviceList></device>"
            f"</deviceList></device></deviceList></device></root>").encode()


def soap_answer(body: str, status: str = "200 OK") -> minihttp.Response:
    envelope = (f'<?xml version="1.0"?><s:Envelope xmlns:s="{upnp.SOAP_ENVELOPE}"><s:Body>{body}</s:Body>'
                "</s:Envelope>").encode()
    return minihttp.parse_response(f"HTTP/1.1 {status}\r\nContent-Length: {len(envelope)}\r\n\r\n".encode() + envelope)


# --- SSDP --------------------------------------------------------------------------------


def test_the_search_asks_for_one_service_type_on_the_ssdp_group():
    request = upnp.search_request(upnp.WAN_IP_1).decode()
    assert request.startswith("M-SEARCH * HTTP/1.1\r\nHOST: 239.255.255.250:1900\r\n")
    assert 'MAN: "ssdp:discover"' in request and f"ST: {upnp.WAN_IP_1}\r\n" in request
    assert request.endswith("\r\n\r\n")


def test_an_answer_from_the_gateway_gives_its_description_url():
    assert upnp.parse_search_response(ssdp_answer(), GATEWAY) == LOCATION
    lower_case = ssdp_answer().replace(b"LOCATION", b"Location").replace(b"ST:", b"st:")
    assert upnp.parse_search_response(lower_case, GATEWAY) == LOCATION


@pytest.mark.parametrize("data, why", [
    (ssdp_answer(location="http://10.1.0.66:5000/rootDesc.xml"), "points away from the gateway"),
    (ssdp_answer(location="http://router.lan:5000/rootDesc.xml"), "IP address"),
    (ssdp_answer(location="https://10.1.0.1:5000/rootDesc.xml"), "plain http"),
    (ssdp_answer(location="http://admin:pw@10.1.0.1:5000/"), "plain http"),
    (ssdp_answer(location="http://10.1.0.1:99999/"), "URL"),
    (ssdp_answer(location="file:///etc/passwd"), "plain http"),
    (ssdp_answer(st="urn:schemas-upnp-org:device:MediaServer:1"), "an SSDP answer for"),
    (ssdp_answer(status="NOTIFY * HTTP/1.1"), "not an SSDP search answer"),
    (ssdp_answer() + b"X" * upnp.MAX_SSDP_SIZE, "at most"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "header line"),
])
def test_ssdp_answers_we_refuse(data, why):
    with pytest.raises(Malformed, match=why):
        upnp.parse_search_response(data, GATEWAY)


# --- the device description ----------------------------------------------------------------


def test_miniupnpds_description_gives_its_v2_service():
    assert upnp.parse_description(captured("rootDesc.xml"), LOCATION) == V2
    assert V2.version == 2


def test_the_best_service_wins_and_urls_resolve_against_urlbase_or_the_location():
    both = description((upnp.WAN_PPP_1, "/ppp"), (upnp.WAN_IP_1, "ip"))
    assert upnp.parse_description(both, LOCATION) == upnp.Service(upnp.WAN_IP_1, minihttp.Url(GATEWAY, 5000, "/ip"))
    based = description((upnp.WAN_PPP_1, "/ppp?x=1"), base=f"http://{GATEWAY}:49000/")
    assert upnp.parse_description(based, LOCATION).control == minihttp.Url(GATEWAY, 49000, "/ppp?x=1")


@pytest.mark.parametrize("body, why", [
    (description((upnp.WAN_IP_2, "http://192.0.2.7/ctl")), "points away from the gateway"),
    (description((upnp.WAN_IP_2, "/ctl"), base="http://192.0.2.7:80/"), "points away from the gateway"),
    (description(("urn:schemas-upnp-org:service:Layer3Forwarding:1", "/l3f")), "no WAN connection service"),
    (b"<root><device>", "not well-formed"),
    (b"", "not well-formed"),
    (b"<a>" * 40 + b"</a>" * 40, "deeper"),
    (b"<r>" + b"<s/>" * 3000 + b"</r>", "more than"),
    (b"<r>" + b" " * upnp.MAX_DESCRIPTION_SIZE + b"</r>", "at most"),
])
def test_descriptions_we_refuse(body, why):
    with pytest.raises(Malformed, match=why):
        upnp.parse_description(body, LOCATION)


@pytest.mark.parametrize("body", [
    b'<?xml version="1.0"?><!DOCTYPE r [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">'
    b'<!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;">]><r>&c;&c;&c;&c;&c;&c;&c;&c;</r>',  # "billion laughs"
    b'<?xml version="1.0"?><!DOCTYPE r [<!ENTITY x SYSTEM "file:///etc/passwd">]><r>&x;</r>',  # external entity
    b'<?xml version="1.0"?><!DOCTYPE r SYSTEM "http://192.0.2.7/evil.dtd"><r/>',  # external DTD
])
def test_no_document_type_is_accepted_so_no_entity_expands(body):
    with pytest.raises(Malformed, match="document type"):
        safexml.parse(body)


def test_the_xml_tree_keeps_names_namespaces_and_text():
    root = safexml.parse(b'<a xmlns="urn:x"><b>one &amp; two</b><c><b>deep</b></c></a>')
    assert (root.namespace, root.name) == ("urn:x", "a")
    assert root.child_text("b") == "one & two" and root.child_text("missing") is None
    assert [b.text for b in root.iter("b")] == ["one & two", "deep"]


# --- SOAP ------------------------------------------------------------------------------------


def test_add_port_mapping_is_a_soap_post_with_the_arguments_in_order():
    request = upnp.add_port_mapping(V2, 4100, "10.1.0.2", 4100, 7200, "meshd <&>")
    head, body = request.split(b"\r\n\r\n", 1)
    assert head.startswith(b"POST /ctl/IPConn HTTP/1.1\r\nHost: 10.1.0.1:5000\r\nConnection: close\r\n")
    assert f'SOAPAction: "{upnp.WAN_IP_2}#AddPortMapping"'.encode() in head
    assert f"Content-Length: {len(body)}".encode() in head
    call = safexml.parse(body).child("Body").children[0]
    assert (call.namespace, call.name) == (upnp.WAN_IP_2, "AddPortMapping")
    assert [(arg.name, arg.text) for arg in call.children] == [
        ("NewRemoteHost", ""), ("NewExternalPort", "4100"), ("NewProtocol", "UDP"), ("NewInternalPort", "4100"),
        ("NewInternalClient", "10.1.0.2"), ("NewEnabled", "1"), ("NewPortMappingDescription", "meshd <&>"),
        ("NewLeaseDuration", "7200")]
    any_port = upnp.add_port_mapping(V2, 4100, "10.1.0.2", 4100, 60, "meshd", any_port=True)
    assert b"#AddAnyPortMapping" in any_port
    assert b"<NewExternalPort>4100</NewExternalPort><NewProtocol>UDP" in upnp.delete_port_mapping(V2, 4100)


def test_miniupnpds_answers_are_read():
    answer = minihttp.parse_response(captured("get-external-ip.http"))
    assert upnp.parse_soap_response(answer, V2, "GetExternalIPAddress") == {"NewExternalIPAddress": "198.51.100.10"}
    added = upnp.parse_soap_response(minihttp.parse_response(captured("add-any.http")), V2, "AddAnyPortMapping")
    assert upnp.port_argument(added, "NewReservedPort") == 4100
    with pytest.raises(upnp.UpnpError, match="718: ConflictInMappingEntry") as fault:
        upnp.parse_soap_response(minihttp.parse_response(captured("add-fault-718.http")), V2, "AddPortMapping")
    assert fault.value.code == upnp.CONFLICT_IN_MAPPING_ENTRY


def test_http_errors_without_a_fault_are_upnp_errors():
    with pytest.raises(upnp.UpnpError, match="HTTP status 404") as error:
        upnp.parse_soap_response(minihttp.Response(404, b"not found"), V2, "GetExternalIPAddress")
    assert error.value.code == 0
    with pytest.raises(upnp.UpnpError, match="HTTP status 500"):
        upnp.parse_soap_response(soap_answer(f'<u:GetExternalIPAddressResponse xmlns:u="{upnp.WAN_IP_2}"/>',
                                             "500 Internal Server Error"), V2, "GetExternalIPAddress")


@pytest.mark.parametrize("response, why", [
    (soap_answer(f'<u:AddPortMappingResponse xmlns:u="{upnp.WAN_IP_2}"/>'), "AddPortMappingResponse"),
    (soap_answer(f'<u:GetExternalIPAddressResponse xmlns:u="{upnp.WAN_IP_1}"/>'), "GetExternalIPAddressResponse"),
    (soap_answer(""), "SOAP envelope"),
    (minihttp.Response(200, b"<Envelope><Body><x/></Body></Envelope>"), "SOAP envelope"),
    (minihttp.Response(200, b"<not xml"), "not well-formed"),
    (minihttp.Response(200, b"<a>" + b" " * upnp.MAX_SOAP_SIZE + b"</a>"), "at most"),
])
def test_soap_answers_we_refuse(response, why):
    with pytest.raises(Malformed, match=why):
        upnp.parse_soap_response(response, V2, "GetExternalIPAddress")


@pytest.mark.parametrize("text", ["", "0", "65536", "-1", "80a", "1" * 30])
def test_a_port_argument_must_be_a_port(text):
    with pytest.raises(Malformed, match="is not a port"):
        upnp.port_argument({"NewReservedPort": text}, "NewReservedPort")


# --- HTTP ------------------------------------------------------------------------------------


def test_http_bodies_framed_by_length_chunks_or_the_close():
    assert minihttp.parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabcdef").body == b"abc"
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-T: 1\r\n\r\n"
    assert minihttp.parse_response(chunked).body == b"abcde"
    assert minihttp.parse_response(b"HTTP/1.0 404 Not Found\r\n\r\ngone") == minihttp.Response(404, b"gone")


@pytest.mark.parametrize("data, why", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "Content-Length says 10"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", "truncated"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n", "end of its headers"),
    (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 2000 + b"\r\n", "too long"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "status line"),
    (b"HTTP/1.1 2x0 OK\r\n\r\n", "status line"),
    (b"HTTP/1.1 200 OK\r\n bad: header\r\n\r\n", "header line"),
])
def test_broken_http_answers_are_malformed(data, why):
    with pytest.raises(Malformed, match=why):
        minihttp.parse_response(data)


def test_requests_refuse_header_injection():
    with pytest.raises(ValueError, match="line break"):
        minihttp.request("GET", LOCATION, [("X", "a\r\nHost: elsewhere")])


@given(st.binary(max_size=600))
def test_garbage_raises_only_malformed_or_upnp_errors(data):
    for parse in (lambda d: upnp.parse_search_response(d, GATEWAY), minihttp.parse_response,
                  lambda d: upnp.parse_description(d, LOCATION),
                  lambda d: upnp.parse_soap_response(minihttp.Response(200, d), V2, "AddPortMapping")):
        try:
            parse(data)
        except (Malformed, upnp.UpnpError):
            pass
