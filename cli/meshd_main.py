"""``meshd``: create a node's identity and run the daemon in the foreground."""

from __future__ import annotations

import argparse
import errno
import logging
import signal

import trio

import meshd
from meshd.config import CONFIG_FILE
from meshd.daemon import Config
from meshd.groups import leaves
from meshd.identity import KEY_FILE, create_identity, load_identity

from . import heap
from .common import data_dir_argument, fail
from .logs import configure

log = logging.getLogger("meshd")


def cmd_init(args: argparse.Namespace) -> None:
    data_dir = args.data_dir
    if (data_dir / KEY_FILE).exists():
        identity = load_identity(data_dir)
        print(f"already initialized: {identity.peer_id} (key kept)")
    else:
        identity = create_identity(data_dir)
        print(f"created identity {identity.peer_id}")
    config_path = data_dir / CONFIG_FILE
    if not config_path.exists():
        config_path.write_text(Config().render())
        print(f"wrote {config_path} with every default")


async def _run(args: argparse.Namespace) -> None:
    async with meshd.open_node(args.data_dir, listen=args.listen, bootstrap=args.bootstrap) as node:
        print(f"ready {node.address}", flush=True)
        heap.settle()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(heap.refreeze_after_imports)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    log.info("%s received: closing connections and storage", signal.Signals(signum).name)
                    break
            nursery.cancel_scope.cancel()
    log.info("stopped")


def cmd_start(args: argparse.Namespace) -> None:
    config = Config.load(args.data_dir) if args.data_dir.exists() else Config()
    configure(config.log, args.log_level or config.node.log_level, format=args.log_format)
    try:
        try:
            trio.run(_run, args)
        except BaseExceptionGroup as group:  # a start that failed inside the node's nurseries
            raise _the_cause(group) from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise _port_in_use(args.listen or config.node.listen) from None
        raise


def _the_cause(group: BaseExceptionGroup) -> BaseException:
    """The one error (not counting the cancellations it caused) a failed start raised, or the group."""
    failures = [e for e in leaves(group) if not isinstance(e, trio.Cancelled)]
    return failures[0] if len(failures) == 1 else group


def _port_in_use(listen: object) -> RuntimeError:
    return RuntimeError(f"UDP {listen} is in use by another program (another meshd?); "
                        "pick a free port with --listen HOST:PORT or [node] listen in config.toml")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="meshd", description="meshd peer-to-peer mesh daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="create the identity key and config.toml")
    data_dir_argument(init)
    init.set_defaults(func=cmd_init)
    start = sub.add_parser("start", help="run the daemon in the foreground")
    data_dir_argument(start)
    start.add_argument("--listen", help="UDP HOST:PORT to listen on (default from config: 0.0.0.0:4100)")
    start.add_argument("--bootstrap", nargs="*", default=None, metavar="ADDR",
                       help="PEERID@HOST:PORT of peers to join through")
    start.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    start.add_argument("--log-format", choices=["text", "json"],
                       help="one event per line as text or JSON (default from config: [log] format)")
    start.set_defaults(func=cmd_start)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except KeyboardInterrupt:
        pass
    except (meshd.IdentityError, meshd.ConfigError, meshd.AddressError, ValueError) as exc:
        fail("meshd", str(exc))
    except OSError as exc:
        fail("meshd", f"{exc.strerror or exc} ({getattr(exc, 'filename', '') or 'socket'})")
    except RuntimeError as exc:
        fail("meshd", str(exc))


if __name__ == "__main__":
    main()
