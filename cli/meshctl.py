"""``meshctl``: inspect and steer the local meshd through its control socket.

Every command prints a rich table or line for people, or JSON with ``--json``
for scripts.  Failures are one line on stderr and exit code 1 (2 for usage).
The commands live in :mod:`cli.commands`, one module per capability, named
as the service is (``node`` is the core's).

A command starts in about a tenth of a second (docs/performance.md): it
imports no trio, no daemon and no QUIC, only the client's methods, which run
over a blocking socket (:mod:`meshd.client.blocking`), and rich once it
prints.  ``tests/unit/meshd/test_lazy_imports.py`` keeps it so.
"""

from __future__ import annotations

import argparse

import meshd
from meshd.client.blocking import BlockingClient, run
from meshd.control.socket import socket_path

from .commands import crdt, dht, doctor, experts, learning, nat, node, shards, top
from .common import data_dir_argument, fail, to_json


def _parser() -> argparse.ArgumentParser:
    def options(parser: argparse.ArgumentParser, suppress: bool) -> argparse.ArgumentParser:
        data_dir_argument(parser, suppress=suppress)
        parser.add_argument("--json", action="store_true", help="print JSON for scripts",
                            default=argparse.SUPPRESS if suppress else False)
        return parser

    common = options(argparse.ArgumentParser(add_help=False), suppress=True)
    parser = options(argparse.ArgumentParser(prog="meshctl", description="control a running meshd"),
                     suppress=False)
    sub = parser.add_subparsers(dest="command", required=True)
    for commands in (node, nat, dht, crdt, shards, learning, experts, doctor, top):
        commands.add_parser(sub, common)
    return parser


async def _run(args) -> None:
    client = BlockingClient(socket_path(args.data_dir))
    await client.id()  # DaemonNotRunning before anything else, as meshd.connect does
    result, show = await args.func(client, args)
    if show is None:  # the command printed as it went
        return
    if args.json:
        print(to_json(result))
    else:
        show()
    if getattr(args, "exit_code", 0):  # a command that reports failures (doctor) says so
        raise SystemExit(args.exit_code)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if getattr(args, "count", None) is not None and args.count < 1:
        fail("meshctl", "--count must be at least 1", 2)
    try:
        run(_run, args)
    except KeyboardInterrupt:
        raise SystemExit(130)
    except meshd.DaemonNotRunning as exc:
        fail("meshctl", str(exc))
    except meshd.RpcError as exc:
        fail("meshctl", exc.message or exc.code)


if __name__ == "__main__":
    main()
