"""The metrics service's config section, ``[metrics]``: where the Prometheus exporter listens."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ...address import AddressError, HostPort
from ...config import ConfigError


@dataclass
class MetricsSection:
    # HOST:PORT of the Prometheus HTTP exporter, e.g. "127.0.0.1:9464"; "" runs none
    listen: str = ""
    # let `listen` be an address other than loopback (whoever reaches it reads the figures)
    allow_remote: bool = False

    def address(self) -> HostPort | None:
        """Where the exporter listens, or None when it is off.

        ConfigError for a malformed address, or one that is not loopback while
        ``allow_remote`` is false.
        """
        if not self.listen:
            return None
        try:
            address = HostPort.parse(self.listen, allow_zero_port=True)
        except AddressError as exc:
            raise ConfigError(f"metrics.listen: {exc}") from None
        if not (self.allow_remote or _is_loopback(address.host)):
            raise ConfigError(f"metrics.listen: {self.listen} is not a loopback address; "
                              "set metrics.allow_remote = true to serve figures beyond this host")
        return address


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
