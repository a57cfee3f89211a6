"""Coverage-guided fuzzing of the decoders with atheris (libFuzzer for Python).

    python tests/fuzz/run.py TARGET [--seconds N]
    python tests/fuzz/run.py all [--seconds N]
    python tests/fuzz/run.py all --merge
    python tests/fuzz/run.py --list

Each target (``targets.TARGETS``) runs in its own process, our packages
instrumented, starting from ``corpus/<target>/``.  Inputs that reach new code
are kept in a scratch folder (``$TMPDIR/meshd-fuzz/<target>``); ``--merge``
(instead of fuzzing) adds to the repo's corpus only those that reach code
the corpus does not.
An input that raises what the target does not allow, hangs for 10 s or takes
more than 2 GB is saved as ``crashes/<target>/crash-…`` (``timeout-…``,
``oom-…``) and the run stops: fix the decoder, and the file stays as a
regression test (``tests/unit/test_fuzz_corpus.py`` runs every one).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
INSTRUMENTED = ["nat", "dht", "crdt", "learn", "experts", "meshd"]  # our packages, not the libraries under them
MAX_LEN = 16384  # bytes of one input: seeds are well under it, and so is every decoder's interesting input
WORKER = "--worker"
INSTALL = "atheris is not installed: pip install atheris==3.0.0 (a cp311 manylinux wheel)"


def libfuzzer_args(name: str, seconds: int, merge: bool) -> list[str]:
    """The libFuzzer command line for ``name``: fuzzing for ``seconds``, the scratch folder
    (where new inputs go) first and the repo corpus after; with ``merge``, a merge of the
    scratch folder into the corpus instead."""
    scratch = Path(tempfile.gettempdir()) / "meshd-fuzz" / name
    corpus = HERE / "corpus" / name
    crashes = HERE / "crashes" / name
    for folder in (scratch, corpus, crashes):
        folder.mkdir(parents=True, exist_ok=True)
    if merge:
        return ["-merge=1", str(corpus), str(scratch)]
    return [str(scratch), str(corpus), f"-max_total_time={seconds}", "-timeout=10", "-rss_limit_mb=2048",
            f"-max_len={MAX_LEN}", f"-artifact_prefix={crashes}/", "-print_final_stats=1"]


def fuzz(name: str, args: list[str]) -> None:
    """Run libFuzzer on target ``name`` in this process (it exits when done)."""
    import atheris  # noqa: PLC0415

    import torch  # noqa: F401, PLC0415  (loaded before the hook: only our packages are instrumented)

    with atheris.instrument_imports(include=INSTRUMENTED):
        from targets import TARGETS  # noqa: PLC0415
    atheris.Setup([sys.argv[0], *args], TARGETS[name])
    atheris.Fuzz()


def main() -> int:
    """Fuzz the targets asked for, one process each, in turn; non-zero if one found something."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", nargs="?", help="a target of targets.TARGETS, or 'all'")
    parser.add_argument("--seconds", type=int, default=60, help="how long to fuzz each target (default 60)")
    parser.add_argument("--merge", action="store_true",
                        help="do not fuzz: add the inputs earlier runs kept that reach new code to the repo's corpus")
    parser.add_argument("--list", action="store_true", help="print the targets and exit")
    options = parser.parse_args()
    from targets import TARGETS  # noqa: PLC0415

    if options.list:
        print("\n".join(TARGETS))
        return 0
    try:
        import atheris  # noqa: F401, PLC0415
    except ImportError:
        print(INSTALL)
        return 2
    if options.target != "all" and options.target not in TARGETS:
        parser.error(f"unknown target {options.target!r}; --list shows them")
    names = list(TARGETS) if options.target == "all" else [options.target]
    failed = []
    for name in names:
        args = libfuzzer_args(name, options.seconds, options.merge)
        if subprocess.run([sys.executable, __file__, WORKER, name, *args], check=False).returncode:
            failed.append(name)
    if failed:
        print(f"findings in: {', '.join(failed)} (see {HERE / 'crashes'})")
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == [WORKER]:  # one target's process: run.py --worker NAME LIBFUZZER-ARGS...
        fuzz(sys.argv[2], sys.argv[3:])
    sys.exit(main())
