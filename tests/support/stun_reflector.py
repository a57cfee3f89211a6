"""A one-address STUN server for miniupnpd's start-up check (run in a lab namespace).

    python tests/support/stun_reflector.py ADDRESS PORT

miniupnpd refuses to map ports when its WAN address is in a reserved range,
as the lab's TEST-NET-2 is, unless ``ext_perform_stun=yes`` lets a STUN
server vouch that nothing filters in front of it: it sends four Binding
requests carrying RFC 3489 CHANGE-REQUEST flags and wants all four answered
with its own address and port.  A server with one address cannot honour the
flags, and RFC 8489 servers (coturn, meshd) answer 420 to them; this one
answers every Binding request with a success naming its source, from
ADDRESS:PORT, which is the truth in the lab: no NAT stands between a router's
WAN interface and the public segment.  Prints ``ready`` once it listens.
"""

import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from nat.stun import BINDING, StunClass, StunError, UnknownAttributesError, binding_success, decode  # noqa: E402


def reply(data: bytes, source: tuple[str, int]) -> bytes | None:
    """The success response to a Binding request in ``data`` (CHANGE-REQUEST ignored), else None."""
    try:
        request = decode(data)
    except UnknownAttributesError as exc:
        request = exc.parsed
    except StunError:
        return None
    if request.cls != StunClass.REQUEST or request.method != BINDING:
        return None
    return binding_success(request, source).encode()


def main(address: str, port: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((address, port))
    print("ready", flush=True)
    while True:
        data, source = sock.recvfrom(2048)
        answer = reply(data, source)
        if answer is not None:
            sock.sendto(answer, source)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
