"""The daemon's logging: one event per line, as text (the default) or JSON, with
a level per subsystem.

A subsystem is a logger name (``meshd.dht``, ``meshd.relay``, ``quic``); a level
set for one applies to the names under it too.  A JSON line holds ``ts`` (UNIX
seconds), ``level``, ``subsystem``, ``message``, and ``exc`` when an exception
was logged, so ``jq`` and log shippers read it without parsing text.
"""

from __future__ import annotations

import json
import logging
import sys

from meshd.config import LOG_LEVELS, ConfigError, LogConfig

TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
QUIET = {"quic": "warning"}  # aioquic's per-packet chatter, unless the config asks for it


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object on one line."""

    def format(self, record: logging.LogRecord) -> str:
        event = {"ts": round(record.created, 6), "level": record.levelname.lower(),
                 "subsystem": record.name, "message": record.getMessage()}
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        return json.dumps(event, ensure_ascii=False, default=repr)


def configure(config: LogConfig, level: str, *, format: str | None = None) -> None:
    """Send the daemon's log to stderr in ``format`` (default: the config's) at
    ``level``, with the config's levels per subsystem over it.

    ConfigError names a level that is not one of :data:`meshd.config.LOG_LEVELS`.
    """
    levels = {**QUIET, **config.levels}
    for name, value in levels.items():
        if value not in LOG_LEVELS:
            raise ConfigError(f"log.levels: {name} = {value!r} is not one of {', '.join(LOG_LEVELS)}")
    handler = logging.StreamHandler(sys.stderr)
    json_lines = (format or config.format) == "json"
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name, value in levels.items():
        logging.getLogger(name).setLevel(value.upper())
