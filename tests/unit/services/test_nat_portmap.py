"""The port-mapping shell's decisions: which addresses count, when to renew, how UPnP refusals are met.

The UPnP client talks to a scripted SOAP server on loopback (its discovery is
skipped: the lab tests run it against miniupnpd).
"""

import functools
import random

import pytest
import trio

from meshd.config import ConfigError
from meshd.services.nat.mapping import PortMapError, check_external
from meshd.services.nat.portmap import PortMapper, renew_in
from meshd.services.nat.upnp import UpnpClient
from nat import minihttp, upnp


@pytest.mark.parametrize("address", ["198.51.100.10", "203.0.113.5", "8.8.8.8", "2001:db8::1"])
def test_public_external_addresses_are_used(address):
    check_external(address)


@pytest.mark.parametrize("address", ["10.0.0.1", "172.20.1.1", "192.168.1.1", "100.64.0.1", "127.0.0.1",
                                     "169.254.1.1", "0.0.0.0", "224.0.0.1", "", "router"])
def test_external_addresses_behind_another_nat_or_bogus_are_not(address):
    with pytest.raises(PortMapError):
        check_external(address)


def test_renewal_comes_at_half_the_lifetime_and_permanent_mappings_are_refreshed():
    assert renew_in(7200, 7200) == 3600
    assert renew_in(1, 7200) == 1.0  # never busier than once a second
    assert renew_in(0, 600) == 300  # permanent: refreshed at half what we asked


@pytest.mark.parametrize("protocols, lifetime", [([], 7200), (["upnp", "igd"], 7200), (["pcp"], 0)])
def test_bad_config_is_a_config_error(protocols, lifetime):
    with pytest.raises(ConfigError, match="nat.port_mapping"):
        PortMapper(None, protocols, lifetime)


def fault(code: int) -> tuple[int, str]:
    return 500, (f'<s:Fault><detail><UPnPError xmlns="urn:schemas-upnp-org:control-1-0"><errorCode>{code}'
                 "</errorCode><errorDescription>no</errorDescription></UPnPError></detail></s:Fault>")


def ok(action: str, service_type: str, args: str = "") -> tuple[int, str]:
    return 200, f'<u:{action}Response xmlns:u="{service_type}">{args}</u:{action}Response>'


async def scripted_gateway(nursery, service_type: str, script: dict[str, list[tuple[int, str]]]):
    """A SOAP server on loopback answering each action from ``script`` in turn;
    returns the service and the list of (action, body) it was asked."""
    asked = []

    async def handle(stream):
        data = b""
        while b"</s:Envelope>" not in data:
            data += await stream.receive_some(65536)
        action = data.split(b"#", 1)[1].split(b'"', 1)[0].decode()
        asked.append((action, data.split(b"\r\n\r\n", 1)[1].decode()))
        status, body = script[action].pop(0)
        envelope = f'<s:Envelope xmlns:s="{upnp.SOAP_ENVELOPE}"><s:Body>{body}</s:Body></s:Envelope>'.encode()
        await stream.send_all(f"HTTP/1.1 {status} X\r\nContent-Length: {len(envelope)}\r\n\r\n".encode() + envelope)
        await stream.aclose()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return upnp.Service(service_type, minihttp.Url("127.0.0.1", port, "/ctl")), asked


def client_for(service: upnp.Service) -> UpnpClient:
    client = UpnpClient("127.0.0.1", 4100, rng=random.Random(1))
    client._service, client._local = service, "10.1.0.2"  # what discovery would have found
    return client


EXTERNAL = [ok("GetExternalIPAddress", upnp.WAN_IP_1, "<NewExternalIPAddress>198.51.100.10</NewExternalIPAddress>")]


async def test_a_v1_gateway_with_our_port_taken_gets_a_random_one(nursery):
    service, asked = await scripted_gateway(nursery, upnp.WAN_IP_1, {
        "GetExternalIPAddress": list(EXTERNAL),
        "AddPortMapping": [fault(718), ok("AddPortMapping", upnp.WAN_IP_1)]})
    lease = await client_for(service).map(600)
    chosen = random.Random(1).randrange(1024, 65536)
    assert (str(lease.external), lease.lifetime) == (f"198.51.100.10:{chosen}", 600)
    assert [action for action, _ in asked] == ["GetExternalIPAddress", "AddPortMapping", "AddPortMapping"]
    assert f"<NewExternalPort>{chosen}</NewExternalPort>" in asked[-1][1]


async def test_a_gateway_with_permanent_leases_only_gets_one_and_it_is_deleted(nursery):
    service, asked = await scripted_gateway(nursery, upnp.WAN_IP_1, {
        "GetExternalIPAddress": list(EXTERNAL),
        "AddPortMapping": [fault(725), ok("AddPortMapping", upnp.WAN_IP_1)],
        "DeletePortMapping": [ok("DeletePortMapping", upnp.WAN_IP_1)]})
    client = client_for(service)
    lease = await client.map(600)
    assert lease.lifetime == 0 and "<NewLeaseDuration>0</NewLeaseDuration>" in asked[2][1]
    await client.unmap()
    assert asked[-1][0] == "DeletePortMapping" and "<NewExternalPort>4100</NewExternalPort>" in asked[-1][1]


async def test_a_v2_gateway_without_add_any_falls_back_and_renewals_keep_the_port(nursery):
    external = [ok("GetExternalIPAddress", upnp.WAN_IP_2,
                   "<NewExternalIPAddress>198.51.100.10</NewExternalIPAddress>")] * 2
    service, asked = await scripted_gateway(nursery, upnp.WAN_IP_2, {
        "GetExternalIPAddress": external, "AddAnyPortMapping": [fault(401)],
        "AddPortMapping": [ok("AddPortMapping", upnp.WAN_IP_2)] * 2})
    client = client_for(service)
    assert str((await client.map(600)).external) == "198.51.100.10:4100"
    assert str((await client.map(600)).external) == "198.51.100.10:4100"
    assert [action for action, _ in asked] == ["GetExternalIPAddress", "AddAnyPortMapping", "AddPortMapping",
                                               "GetExternalIPAddress", "AddPortMapping"]


async def test_a_private_external_address_or_another_refusal_is_no_mapping(nursery):
    service, asked = await scripted_gateway(nursery, upnp.WAN_IP_1, {
        "GetExternalIPAddress": [ok("GetExternalIPAddress", upnp.WAN_IP_1,
                                    "<NewExternalIPAddress>192.168.0.2</NewExternalIPAddress>"), *EXTERNAL],
        "AddPortMapping": [fault(606)]})
    client = client_for(service)
    with pytest.raises(PortMapError, match="not public"):
        await client.map(600)
    with pytest.raises(PortMapError, match="UPnP error 606"):
        await client.map(600)
    assert [action for action, _ in asked] == ["GetExternalIPAddress", "GetExternalIPAddress", "AddPortMapping"]
