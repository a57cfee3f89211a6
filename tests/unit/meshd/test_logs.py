"""The daemon's logs: one JSON object per line with subsystem and level, levels per
subsystem over the base level, and the [log] section read and written back."""

from __future__ import annotations

import json
import logging
import tomllib

import pytest

from cli.logs import configure
from meshd.config import ConfigError, LogConfig
from meshd.daemon import Config


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    names = ("meshd.dht", "meshd.node", "quic")
    levels = {name: logging.getLogger(name).level for name in names}
    yield
    root.handlers[:], level = saved
    root.setLevel(level)
    for name, value in levels.items():
        logging.getLogger(name).setLevel(value)


def test_json_logs_are_one_object_per_line_with_subsystem_and_level(capsys, restore_logging):
    configure(LogConfig(levels={"meshd.dht": "debug"}), "info", format="json")
    logging.getLogger("meshd.dht").debug("lookup of %s took %d hops", "abc", 3)
    logging.getLogger("meshd.node").debug("not shown: below the base level")
    logging.getLogger("meshd.node").info("connected to %s", "peer\nwith a newline")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("meshd.rpc").warning("handler failed", exc_info=True)
    lines = capsys.readouterr().err.splitlines()
    events = [json.loads(line) for line in lines]
    assert [(e["subsystem"], e["level"]) for e in events] == [
        ("meshd.dht", "debug"), ("meshd.node", "info"), ("meshd.rpc", "warning")]
    assert events[0]["message"] == "lookup of abc took 3 hops"
    assert events[1]["message"] == "connected to peer\nwith a newline"
    assert "ValueError: boom" in events[2]["exc"]
    assert all(isinstance(e["ts"], float) for e in events)


def test_text_logs_are_the_default_and_a_subsystem_can_be_quieter(capsys, restore_logging):
    configure(LogConfig(levels={"meshd.node": "error"}), "debug")
    logging.getLogger("meshd.node").warning("hidden")
    logging.getLogger("meshd.dht").debug("shown")
    logging.getLogger("quic").info("hidden: aioquic is quiet unless asked")
    err = capsys.readouterr().err
    assert "hidden" not in err and err.count("\n") == 1
    assert " DEBUG   meshd.dht: shown" in err


def test_a_bad_level_names_its_key(restore_logging):
    with pytest.raises(ConfigError, match="log.levels: meshd.dht"):
        configure(LogConfig(levels={"meshd.dht": "loud"}), "info")


def test_the_log_section_is_written_and_read_back(tmp_path):
    config = Config()
    config.update({"log": {"format": "json", "levels": {"meshd.dht": "debug", "quic": "info"}}})
    text = config.render()
    assert tomllib.loads(text)["log"] == {"format": "json", "levels": {"meshd.dht": "debug", "quic": "info"}}
    assert tomllib.loads(Config().render())["log"] == {"format": "text", "levels": {}}
    with pytest.raises(ConfigError, match="log.format"):
        Config().update({"log": {"format": "xml"}})
    with pytest.raises(ConfigError, match="log.levels"):
        Config().update({"log": {"levels": {"meshd.dht": 3}}})
