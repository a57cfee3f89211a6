"""Every service has the one shape of meshd.service.Service, built on a fake host."""

import msgpack
import pytest
from fakehost import FakeHost

from meshd.daemon import SERVICES, Config, build_services
from meshd.service import Method

# The nat service keeps the method names it had before services existed, so
# the wire protocol and meshctl did not change (docs/architecture.md).
_HISTORIC = {"nat": ("nat", "stun", "relay", "punch", "autonat.", "relay.", "punch.")}


@pytest.fixture
def services(tmp_path):
    built = build_services(FakeHost(tmp_path), Config(), SERVICES)
    yield built
    for service in built:
        service.close()


def _owned(service, method: str) -> bool:
    prefixes = (f"{service.name}.", *_HISTORIC.get(service.name, ()))
    return method.startswith(prefixes) or method in _HISTORIC.get(service.name, ())


def test_every_service_is_built_in_order_under_its_own_name(services):
    assert [s.name for s in services] == list(SERVICES)


def test_each_method_carries_its_services_name(services):
    for service in services:
        for method in [*service.rpc_methods(), *service.control_methods()]:
            assert _owned(service, method), f"{service.name} registers {method}"


def test_no_two_services_register_one_method(services):
    seen: dict[str, str] = {}
    for service in services:
        for method in [*service.rpc_methods(), *service.control_methods()]:
            assert seen.setdefault(method, service.name) == service.name, f"{method}: {seen[method]} and {service.name}"


def test_handlers_are_callables_or_methods_with_a_known_kind(services):
    for service in services:
        for name, handler in [*service.rpc_methods().items(), *service.control_methods().items()]:
            if isinstance(handler, Method):
                assert handler.kind in ("bidi", "client_stream"), name
                handler = handler.handler
            assert callable(handler), name


async def test_status_is_a_small_map_the_control_socket_can_send(services):
    for service in services:
        status = service.status()
        assert isinstance(status, dict) and status, service.name
        assert len(msgpack.packb(status)) < 1024, service.name


def test_services_reach_the_node_only_through_the_host(tmp_path):
    host = FakeHost(tmp_path)
    nat, dht, *_ = build_services(host, Config(), SERVICES)
    assert host.endpoint.stun_hook is not None  # nat answers STUN on the node's socket
    assert host.routes == [nat]  # relays are a way to reach a peer with no address
    assert len(host.lookups) == 1  # the DHT finds a peer's addresses
    assert host.identify_fields and host.protected and host.address_sources
    for service in (nat, dht, *_):
        service.close()


def test_a_service_left_out_registers_nothing(tmp_path):
    host = FakeHost(tmp_path)
    built = build_services(host, Config(), ["dht"])
    assert [s.name for s in built] == ["dht"]
    assert host.routes == [] and host.endpoint.stun_hook is None
    for service in built:
        service.close()
