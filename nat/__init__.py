"""NAT traversal: STUN, NAT discovery, AutoNAT, relays, hole punching (issue 3).

A library on its own: it never imports meshd, cli, crdt or dht.  meshd's UDP
endpoint hands STUN datagrams (first byte 0-3, RFC 7983) to
``Endpoint.stun_hook``, where this layer plugs in.

Sans-IO modules (time is a ``now`` argument, randomness an injected
``random.Random``; meshd's trio shells do the I/O):

* ``nat.stun``: the STUN message codec (RFC 8489); ``nat.transaction``: the
  client retransmission state machine; ``nat.stun_server``: the Binding answer;
* ``nat.behaviour``: the NAT's mapping behaviour from STUN observations;
* ``nat.natpmp``: NAT-PMP port-mapping messages (RFC 6886);
* ``nat.pcp``: PCP MAP requests and answers (RFC 6887), epoch checks;
* ``nat.upnp``: UPnP-IGD port mapping: SSDP, device descriptions, SOAP, over
  ``nat.minihttp`` (the HTTP/1.1 a gateway needs) and ``nat.safexml`` (XML
  with no DTD, bounded);
* ``nat.autonat``: AutoNAT dial-back rules and the reachability verdict;
* ``nat.relay``: relay reservations, circuit limits, a relay's reply checked;
* ``nat.punch``: hole-punching method, addresses and burst schedule;
* ``nat.candidates``: host candidates (interface addresses) offered and checked;
* ``nat.beacon``: LAN discovery beacons (signed), their schedule and admission;
* ``nat.portprobe``: port-prediction probing roles, admission and schedule;
* ``nat.errors``: ``Refused`` and ``Malformed``, each with a ``kind`` that
  the shell maps to an RPC error.

Plus a trio Binding client for a shared socket (``nat.stun_client``).  The
classes of the four traversal cores are exported here; their functions and
constants (several named alike, such as ``DIAL_TIMEOUT``) stay in their module.
"""

from .stun import (
    ALTERNATE_SERVER,
    BINDING,
    CHANGE_REQUEST,
    COMPREHENDED,
    ERROR_CODE,
    FINGERPRINT,
    HEADER_SIZE,
    ICE_CONTROLLED,
    ICE_CONTROLLING,
    MAGIC_COOKIE,
    MAPPED_ADDRESS,
    MAX_MESSAGE_SIZE,
    MESSAGE_INTEGRITY,
    MESSAGE_INTEGRITY_SHA256,
    OTHER_ADDRESS,
    PRIORITY,
    RESPONSE_ORIGIN,
    SOFTWARE,
    TRANSACTION_ID_SIZE,
    UNKNOWN_ATTRIBUTES,
    USE_CANDIDATE,
    USERNAME,
    XOR_MAPPED_ADDRESS,
    IntegrityError,
    StunClass,
    StunError,
    StunHeader,
    StunMessage,
    UnknownAttributesError,
    address_value,
    binding_request,
    binding_success,
    decode,
    error_code_value,
    error_response,
    is_stun,
    new_transaction_id,
    parse_header,
    saslprep,
    short_term_key,
    unknown_attributes_value,
    xor_address_value,
)
from .transaction import RC, RM, RTO, ClientTransaction, TransactionTimeout
from .autonat import PerPeerInterval, Verdict
from .errors import Malformed, NatError, Refused
from .portprobe import ProbeAdmission
from .relay import ByteBudget, Circuit, HeldReservations, RelayLimits, Reservations

__all__ = [
    "ALTERNATE_SERVER",
    "BINDING",
    "CHANGE_REQUEST",
    "COMPREHENDED",
    "ERROR_CODE",
    "FINGERPRINT",
    "HEADER_SIZE",
    "ICE_CONTROLLED",
    "ICE_CONTROLLING",
    "MAGIC_COOKIE",
    "MAPPED_ADDRESS",
    "MAX_MESSAGE_SIZE",
    "MESSAGE_INTEGRITY",
    "MESSAGE_INTEGRITY_SHA256",
    "OTHER_ADDRESS",
    "PRIORITY",
    "RC",
    "RESPONSE_ORIGIN",
    "RM",
    "RTO",
    "SOFTWARE",
    "TRANSACTION_ID_SIZE",
    "UNKNOWN_ATTRIBUTES",
    "USE_CANDIDATE",
    "USERNAME",
    "XOR_MAPPED_ADDRESS",
    "ClientTransaction",
    "IntegrityError",
    "StunClass",
    "StunError",
    "StunHeader",
    "StunMessage",
    "TransactionTimeout",
    "UnknownAttributesError",
    "address_value",
    "binding_request",
    "binding_success",
    "decode",
    "error_code_value",
    "error_response",
    "is_stun",
    "new_transaction_id",
    "parse_header",
    "saslprep",
    "short_term_key",
    "unknown_attributes_value",
    "xor_address_value",
    "ByteBudget",
    "Circuit",
    "HeldReservations",
    "Malformed",
    "NatError",
    "PerPeerInterval",
    "ProbeAdmission",
    "Refused",
    "RelayLimits",
    "Reservations",
    "Verdict",
]
