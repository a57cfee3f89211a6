"""Node configuration: ``config.toml`` in the data directory, every key defaulted.

The core's sections are the dataclasses below; each service brings its own
section (see :class:`meshd.daemon.Config`).  Unknown sections or keys, values of
the wrong type, and values outside a key's choices or bounds are errors that
name the key, so a typo is never silently ignored.  A section's field declares
them in its metadata: ``"choices"``, and for a number ``"min"``, ``"max"``
(inclusive) or ``"above"`` (exclusive).  ``render`` writes every key with
its value, which is what ``meshd init`` puts on disk.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .lane import LaneConfig
from .rpc.peer import RpcConfig
from .transport import TransportConfig

CONFIG_FILE = "config.toml"


class ConfigError(ValueError):
    """The configuration file or an override is invalid; the message names the key."""


@dataclass
class NodeConfig:
    listen: str = "0.0.0.0:4100"  # one UDP socket; "[::]:PORT" for IPv4 and IPv6
    bootstrap: list[str] = field(default_factory=list)  # PEERID@HOST:PORT
    log_level: str = "info"
    # the services this node runs, in the order they start; leave one out to turn it off
    # (the core alone runs none; meshd.Config defaults to every service in meshd.daemon)
    services: list[str] = field(default_factory=list)


LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class LogConfig:
    # "text": one readable line per event; "json": one JSON object per line
    format: str = field(default="text", metadata={"choices": ("text", "json")})
    # a level per subsystem (logger name) over node.log_level, e.g. {"meshd.dht" = "debug"}
    levels: dict[str, str] = field(default_factory=dict)


@dataclass
class PeersConfig:
    bootstrap_max_backoff: float = 30.0
    max_addresses_per_peer: int = 8


@dataclass
class CoreConfig:
    """The node core's sections.  :class:`meshd.Config` adds one section per service."""

    node: NodeConfig = field(default_factory=NodeConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    rpc: RpcConfig = field(default_factory=RpcConfig)
    peers: PeersConfig = field(default_factory=PeersConfig)
    log: LogConfig = field(default_factory=LogConfig)
    lane: LaneConfig = field(default_factory=LaneConfig)

    @classmethod
    def load(cls, data_dir: Path) -> "CoreConfig":
        """The config in ``data_dir`` (defaults for whatever it leaves out).

        ConfigError names the file and the fix if it is not TOML, and the key
        if one is unknown or of the wrong type."""
        path = data_dir / CONFIG_FILE
        config = cls()
        if path.exists():
            try:
                raw = tomllib.loads(path.read_text())
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{path} is not valid TOML: {exc}; fix it, "
                                  "or move it aside to start with the defaults") from None
            config.update(raw, source=str(path))
        return config

    def update(self, raw: dict, source: str = "override") -> None:
        """Apply ``{section: {key: value}}``, checking every name, type and bound."""
        for section_name, values in raw.items():
            section = getattr(self, section_name, None)
            if not dataclasses.is_dataclass(section) or not isinstance(values, dict):
                raise ConfigError(f"{source}: unknown section [{section_name}]")
            fields = {f.name: f for f in dataclasses.fields(section)}
            for key, value in values.items():
                if key not in fields:
                    raise ConfigError(f"{source}: unknown key {section_name}.{key}")
                name = f"{section_name}.{key}"
                value = _checked(value, getattr(section, key), name, source)
                metadata = fields[key].metadata
                choices = metadata.get("choices")
                if choices and value not in choices:
                    raise ConfigError(f"{source}: {name} must be one of {', '.join(choices)}, not {value!r}")
                _check_bounds(value, metadata, name, source)
                setattr(section, key, value)

    def render(self) -> str:
        """TOML text with every section and key written out."""
        lines = ["# meshd configuration: every key with its default; edit and restart.", ""]
        for f in dataclasses.fields(self):
            lines.append(f"[{f.name}]")
            section = getattr(self, f.name)
            for key, value in dataclasses.asdict(section).items():
                lines.append(f"{key} = {_toml_value(value)}")
            lines.append("")
        return "\n".join(lines)


def _checked(value: object, default: object, name: str, source: str) -> object:
    expected = type(default)
    if expected is float and type(value) is int:
        return float(value)
    if expected is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{source}: {name} must be a list of strings")
        return value
    if expected is dict:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ConfigError(f"{source}: {name} must be a table of strings")
        return value
    if type(value) is not expected:
        raise ConfigError(f"{source}: {name} must be {expected.__name__}, not {type(value).__name__}")
    return value


def _check_bounds(value: object, metadata, name: str, source: str) -> None:
    """ConfigError naming the key if ``value`` is outside the bounds its field declares."""
    low, high, above = metadata.get("min"), metadata.get("max"), metadata.get("above")
    # written so that NaN fails every bound
    if low is not None and high is not None and not low <= value <= high:
        raise ConfigError(f"{source}: {name} must be from {low} to {high}, not {value!r}")
    if low is not None and not value >= low:
        raise ConfigError(f"{source}: {name} must be at least {low}, not {value!r}")
    if high is not None and not value <= high:
        raise ConfigError(f"{source}: {name} must be at most {high}, not {value!r}")
    if above is not None and not value > above:
        raise ConfigError(f"{source}: {name} must be more than {above}, not {value!r}")


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_value(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)
