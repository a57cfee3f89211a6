"""meshctl starts fast: it imports no daemon, QUIC, services, trio, torch or rich
(docs/performance.md, "meshctl start-up"), and the packages that load their
names on first use still offer every one of them.

Timing is the benchmark's job (benchmarks/cli.py); these tests check what it
depends on, which does not vary from run to run: the modules imported.
"""

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.client.blocking import run

# Each of these costs tens of milliseconds or more to import (trio alone ~110 ms).
HEAVY = ("aioquic", "trio", "torch", "rich", "cryptography", "meshd.daemon", "meshd.node",
         "meshd.transport", "meshd.config", "meshd.services", "meshd.identity", "dht", "crdt",
         "nat", "learn", "experts")

_PROBE = """
import sys
import cli.meshctl
{action}
heavy = {heavy!r}
print(sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy)))
"""


def _heavy_modules_after(action: str) -> list[str]:
    code = _PROBE.format(action=action, heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_importing_meshctl_loads_no_heavy_module():
    assert _heavy_modules_after("") == []


def test_meshctl_help_and_a_command_load_no_heavy_module(tmp_path):
    """``--help``, and a command up to its call (no daemon answers, so it fails
    with one line): the blocking client, the frames, the errors, and nothing more."""
    action = f"""
for argv in (["--help"], ["crdt", "--help"], ["--data-dir", {str(tmp_path)!r}, "crdt", "inc", "d", "c"]):
    try:
        cli.meshctl.main(argv)
    except SystemExit:
        pass
"""
    assert _heavy_modules_after(action) == []


# --- the lazy packages -----------------------------------------------------------------

LAZY = ["meshd", "meshd.rpc", "meshd.control"]


def _type_checking_names(package) -> set[str]:
    """The names a package imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(inspect.getsource(package))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                names |= {alias.asname or alias.name for alias in imp.names}
    return names


@pytest.mark.parametrize("name", LAZY)
def test_a_lazy_package_offers_every_name_it_lists(name):
    package = importlib.import_module(name)
    public = set(package.__all__) - {"__version__"}
    assert public == _type_checking_names(package), "the lazy map and the TYPE_CHECKING imports differ"
    for attr in public:
        assert getattr(getattr(package, attr), "__name__", attr) == attr
    assert public <= set(dir(package))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        package.nope


def test_meshd_offers_the_same_objects_as_their_modules():
    import meshd
    from meshd.client import connect
    from meshd.daemon import open_node
    from meshd.rpc.errors import RpcError
    from meshd.rpc.server import CallContext

    assert (meshd.connect, meshd.open_node, meshd.RpcError, meshd.CallContext) == (
        connect, open_node, RpcError, CallContext)
    from meshd import PeerId, ServiceOff  # noqa: F401  (from-imports go through __getattr__ too)


def test_submodules_still_import_by_name():
    from meshd.rpc import protocol
    from meshd.control import socket

    assert protocol.REQUEST == 0 and socket.SOCKET_FILE == "meshd.sock"


# --- run: coroutines with no event loop -------------------------------------------------


def test_run_returns_what_a_coroutine_that_never_suspends_returns():
    async def add(a, b):
        async def inner():
            return a + b
        return await inner()

    assert run(add, 2, 3) == 5


def test_run_refuses_a_coroutine_that_waits_for_an_event_loop():
    class Suspend:
        def __await__(self):
            yield "an event loop's trap"

    async def waits():
        await Suspend()

    with pytest.raises(RuntimeError, match="waited for an event loop"):
        run(waits)
