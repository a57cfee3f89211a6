"""UPnP Internet Gateway Device port mapping, with no I/O: the client side.

Three steps, each a message built here and an answer checked here:

1. **SSDP discovery**: an M-SEARCH datagram per service type to
   239.255.255.250:1900; an answer names the device description's URL in
   LOCATION.  :func:`parse_search_response` accepts only answers whose
   LOCATION is plain http on the address the answer came from, and the
   caller takes answers from its default gateway only.
2. **The device description** (HTTP GET of LOCATION): :func:`parse_description`
   finds the WAN connection service (WANIPConnection:2, then :1, then
   WANPPPConnection:1) and its control URL, which must be on the gateway too.
   XML is read by :mod:`nat.safexml` (no DTD, bounded size).
3. **SOAP actions** on the control URL: :func:`soap_request` builds
   GetExternalIPAddress, AddPortMapping, AddAnyPortMapping (IGD v2) and
   DeletePortMapping; :func:`parse_soap_response` returns the answer's
   arguments or raises :class:`UpnpError` with the UPnP error code.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urljoin
from xml.sax.saxutils import escape

from . import minihttp, safexml
from .errors import Malformed

SSDP_GROUP = "239.255.255.250"
SSDP_PORT = 1900
MAX_SSDP_SIZE = 2048
MAX_DESCRIPTION_SIZE = 64 * 1024
MAX_SOAP_SIZE = 16 * 1024

WAN_IP_2 = "urn:schemas-upnp-org:service:WANIPConnection:2"
WAN_IP_1 = "urn:schemas-upnp-org:service:WANIPConnection:1"
WAN_PPP_1 = "urn:schemas-upnp-org:service:WANPPPConnection:1"
SERVICE_TYPES = (WAN_IP_2, WAN_IP_1, WAN_PPP_1)  # in order of preference

SOAP_ENVELOPE = "http://schemas.xmlsoap.org/soap/envelope/"
SOAP_ENCODING = "http://schemas.xmlsoap.org/soap/encoding/"

# UPnP error codes a port-mapping client acts on (IGD WANIPConnection:2, section 2.5)
INVALID_ACTION = 401
CONFLICT_IN_MAPPING_ENTRY = 718
ONLY_PERMANENT_LEASES_SUPPORTED = 725


class UpnpError(Exception):
    """The gateway answered a SOAP action with a fault; ``code`` is the UPnP error code (0 if none)."""

    def __init__(self, code: int, description: str):
        super().__init__(f"UPnP error {code}: {description}" if code else description)
        self.code = code


@dataclass(frozen=True)
class Service:
    """The gateway's WAN connection service: its type and where to send its actions."""

    service_type: str
    control: minihttp.Url

    @property
    def version(self) -> int:
        return int(self.service_type.rsplit(":", 1)[1])


# --- 1. SSDP ----------------------------------------------------------------------


def search_request(service_type: str, mx: int = 2) -> bytes:
    """An SSDP M-SEARCH for ``service_type``; devices answer within ``mx`` seconds."""
    return (f"M-SEARCH * HTTP/1.1\r\nHOST: {SSDP_GROUP}:{SSDP_PORT}\r\nMAN: \"ssdp:discover\"\r\n"
            f"MX: {mx}\r\nST: {service_type}\r\n\r\n").encode("ascii")


def parse_search_response(data: bytes, source: str) -> minihttp.Url:
    """The description URL in an M-SEARCH answer received from ``source``.

    Malformed unless it is an HTTP 200 answer of at most
    :data:`MAX_SSDP_SIZE` bytes for one of :data:`SERVICE_TYPES` whose
    LOCATION is plain http on ``source`` itself.
    """
    if len(data) > MAX_SSDP_SIZE:
        raise Malformed(f"an SSDP answer of {len(data)} bytes (at most {MAX_SSDP_SIZE})")
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    status_line, *lines = head.split("\r\n")
    if not status_line.startswith("HTTP/1.1 200"):
        raise Malformed(f"not an SSDP search answer: {status_line[:80]!r}")
    headers = minihttp.parse_headers(lines)
    if headers.get("st") not in SERVICE_TYPES:
        raise Malformed(f"an SSDP answer for {headers.get('st', '')[:80]!r}")
    return minihttp.gateway_url(headers.get("location", ""), source)


# --- 2. the device description ------------------------------------------------------


def description_request(location: minihttp.Url) -> bytes:
    return minihttp.request("GET", location)


def parse_description(body: bytes, location: minihttp.Url) -> Service:
    """The preferred WAN connection service in a device description fetched from ``location``.

    Control URLs are resolved against URLBase (if given) or ``location`` and
    must stay on the gateway.  Malformed if there is no usable service.
    """
    root = safexml.parse(body, max_size=MAX_DESCRIPTION_SIZE)
    base = root.child_text("URLBase") or str(location)
    found: dict[str, minihttp.Url] = {}
    problems = []
    for service in root.iter("service"):
        kind = service.child_text("serviceType")
        control = service.child_text("controlURL")
        if kind not in SERVICE_TYPES or kind in found or not control:
            continue
        try:
            found[kind] = minihttp.gateway_url(urljoin(base, control), location.host)
        except Malformed as exc:
            problems.append(str(exc))
    for kind in SERVICE_TYPES:
        if kind in found:
            return Service(kind, found[kind])
    raise Malformed("no WAN connection service in the device description" +
                    (f" ({'; '.join(problems)})" if problems else ""))


# --- 3. SOAP ------------------------------------------------------------------------


def soap_request(service: Service, action: str, arguments: list[tuple[str, str]] = ()) -> bytes:
    """The HTTP POST invoking ``action`` with ``arguments`` (in the order the service defines)."""
    args = "".join(f"<{name}>{escape(value)}</{name}>" for name, value in arguments)
    body = (f'<?xml version="1.0"?>\r\n<s:Envelope xmlns:s="{SOAP_ENVELOPE}" s:encodingStyle="{SOAP_ENCODING}">'
            f'<s:Body><u:{action} xmlns:u="{service.service_type}">{args}</u:{action}></s:Body>'
            f'</s:Envelope>\r\n').encode()
    headers = [("Content-Type", 'text/xml; charset="utf-8"'),
               ("SOAPAction", f'"{service.service_type}#{action}"')]
    return minihttp.request("POST", service.control, headers, body)


def parse_soap_response(answer: minihttp.Response, service: Service, action: str) -> dict[str, str]:
    """The output arguments of ``action`` from the gateway's HTTP answer.

    Raises :class:`UpnpError` for a SOAP fault (its UPnP error code and
    description) or an HTTP error without one, and Malformed for anything else
    that is not ``<{action}Response>`` in the service's namespace.
    """
    if len(answer.body) > MAX_SOAP_SIZE:
        raise Malformed(f"a SOAP answer of {len(answer.body)} bytes (at most {MAX_SOAP_SIZE})")
    try:
        envelope = safexml.parse(answer.body, max_size=MAX_SOAP_SIZE)
    except Malformed:
        if answer.status != 200:
            raise UpnpError(0, f"HTTP status {answer.status}") from None
        raise
    body = envelope.child("Body")
    if envelope.name != "Envelope" or envelope.namespace != SOAP_ENVELOPE or body is None or not body.children:
        raise Malformed("not a SOAP envelope with a body")
    result = body.children[0]
    if result.name == "Fault":
        raise _fault(result)
    if answer.status != 200:
        raise UpnpError(0, f"HTTP status {answer.status}")
    if result.name != f"{action}Response" or result.namespace != service.service_type:
        raise Malformed(f"a SOAP answer <{result.name}> to {action}")
    return {arg.name: arg.text for arg in result.children}


def _fault(fault: safexml.Element) -> UpnpError:
    error = next(fault.iter("UPnPError"), None)
    code = error.child_text("errorCode") if error is not None else None
    description = (error.child_text("errorDescription") if error is not None else None) or \
        fault.child_text("faultstring") or "SOAP fault"
    return UpnpError(int(code) if code and code.isdigit() else 0, description[:200])


# --- the actions -----------------------------------------------------------------------


def get_external_ip_address(service: Service) -> bytes:
    return soap_request(service, "GetExternalIPAddress")


def add_port_mapping(service: Service, external_port: int, internal_client: str, internal_port: int,
                     lease: int, description: str, *, any_port: bool = False) -> bytes:
    """AddPortMapping (the external port exactly) or, with ``any_port``, IGD v2's
    AddAnyPortMapping (the external port as a hint; the answer names the port given).

    ``lease`` is in seconds, 0 for a permanent mapping.
    """
    arguments = [("NewRemoteHost", ""), ("NewExternalPort", str(external_port)), ("NewProtocol", "UDP"),
                 ("NewInternalPort", str(internal_port)), ("NewInternalClient", internal_client),
                 ("NewEnabled", "1"), ("NewPortMappingDescription", description),
                 ("NewLeaseDuration", str(lease))]
    return soap_request(service, "AddAnyPortMapping" if any_port else "AddPortMapping", arguments)


def delete_port_mapping(service: Service, external_port: int) -> bytes:
    return soap_request(service, "DeletePortMapping", [("NewRemoteHost", ""),
                                                        ("NewExternalPort", str(external_port)),
                                                        ("NewProtocol", "UDP")])


def port_argument(arguments: dict[str, str], name: str) -> int:
    """The port in output argument ``name`` (1-65535), or Malformed."""
    text = arguments.get(name, "")
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise Malformed(f"{name} {text[:20]!r} is not a port")
    return int(text)
