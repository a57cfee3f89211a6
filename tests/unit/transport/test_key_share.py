"""A meshd client offers one key share, X25519, and the handshake settles on it
(aioquic's default is four, a key generated for each: P-256, P-384, X25519, X448)."""

from aioquic.quic.connection import QuicConnection
from aioquic.tls import Group

from test_pmtu_quic import Link


def test_the_client_generates_one_key_and_the_server_agrees_on_x25519():
    link = Link(mtu=1472, max_size=1472, server_probes=False)
    link.settle()
    client, server = link.client.tls, link.server.tls
    assert client._ec_private_keys == [] and client._x448_private_key is None
    assert client._x25519_private_key is not None
    assert server._ec_private_keys == [] and server._x25519_private_key is not None


def test_any_quic_server_takes_the_one_share():
    link = Link(mtu=1472, max_size=1472, server_probes=False, server_class=QuicConnection)
    link.settle()
    assert link.server.tls._x25519_private_key is not None and link.server.tls._ec_private_keys == []
    assert Group.X25519 in link.server.tls._supported_groups
