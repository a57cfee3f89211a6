"""NAT traversal: STUN, NAT discovery, AutoNAT, relays, hole punching (issue 3; not built yet).

A library on its own: it never imports meshd, cli, crdt or dht.  meshd's UDP
endpoint already hands STUN datagrams (first byte 0-3, RFC 7983) to
``Endpoint.stun_hook``, where this layer will plug in.
"""
