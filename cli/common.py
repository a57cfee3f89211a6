"""What both commands share: the data-dir default and one-line errors; and what
``meshctl``'s commands share: adding them, and rich output.

rich is imported when something is printed, not with these modules: ``--help``
and ``--json`` never load it (docs/performance.md, "meshctl start-up").
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NoReturn

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

DEFAULT_DATA_DIR = "~/.meshd"


def data_dir_argument(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """Add --data-dir; ``suppress`` leaves the default to an outer parser."""
    parser.add_argument(
        "--data-dir",
        default=argparse.SUPPRESS if suppress else default_data_dir(),
        type=lambda text: Path(text).expanduser(),
        help="node state: key, config, peer store, control socket "
        f"(default $MESHD_DATA_DIR or {DEFAULT_DATA_DIR})",
    )


def default_data_dir() -> Path:
    return Path(os.environ.get("MESHD_DATA_DIR", DEFAULT_DATA_DIR)).expanduser()


def to_json(value: object) -> str:
    """``value`` as one line of JSON, bytes as hex: what ``--json`` prints."""
    return json.dumps(value, default=lambda v: v.hex() if isinstance(v, bytes) else repr(v))


def fail(prog: str, message: str, code: int = 1) -> NoReturn:
    """Print one line to stderr and exit with ``code``."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


AddCommand = Callable[[str, Callable, str], argparse.ArgumentParser]


def command_adder(subparsers, common: argparse.ArgumentParser) -> AddCommand:
    """``add(name, func, help)``: a subcommand that runs ``func`` and takes the common options."""
    def add(name: str, func: Callable, help: str) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(name, help=help, parents=[common])
        parser.set_defaults(func=func)
        return parser
    return add


def command_group(subparsers, common: argparse.ArgumentParser, name: str, help: str,
                  description: str | None = None, aliases: tuple[str, ...] = ()) -> AddCommand:
    """Command ``name`` (also called ``aliases``) with subcommands of its own;
    returns their :func:`command_adder`."""
    group = subparsers.add_parser(name, help=help, parents=[common], description=description,
                                  aliases=list(aliases))
    return command_adder(group.add_subparsers(dest=f"{name}_command", required=True), common)


@functools.cache
def console(*, stderr: bool = False) -> Console:
    """The rich console printing to stdout (or stderr, for progress), made on first use."""
    from rich.console import Console

    return Console(stderr=stderr)


def rich_table(**options) -> Table:
    """``rich.table.Table(**options)``, rich loaded on first use."""
    from rich.table import Table

    return Table(**options)


def rows_table(title: str, rows: list[dict], columns: list[str]) -> Table:
    """A rich table of ``rows`` (dicts) with ``columns``; a missing value shows as "-"."""
    table = rich_table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*("-" if row.get(c) is None else str(row.get(c)) for c in columns))
    return table
