"""The fuzz targets (tests/fuzz/targets.py) in the fast layer.

Every corpus file and every saved crash of every target runs without an
exception its target does not allow: the crashes are the regression tests of
what fuzzing found.  Hypothesis then feeds each
target arbitrary bytes and its seeds with bytes flipped, inserted and deleted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).parents[2]
FUZZ = ROOT / "tests" / "fuzz"
# pytest put tests/unit on sys.path for this file, whose folders meshd/, dht/, ... would
# import as namespace packages: the repo's packages go first, then the fuzz targets.
sys.path[:0] = [str(FUZZ), str(ROOT)]

from targets import TARGETS  # noqa: E402

FEW = settings(max_examples=15, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


def _files(folder: str) -> list:
    return [pytest.param(name, path, id=f"{name}/{path.name}")
            for name in TARGETS for path in sorted((FUZZ / folder / name).glob("*"))]


def _seeds(name: str) -> list[bytes]:
    return [path.read_bytes() for path in sorted((FUZZ / "corpus" / name).glob("*"))]


def test_every_target_has_seeds():
    assert all(_seeds(name) for name in TARGETS)


@pytest.mark.parametrize(("name", "path"), _files("corpus") + _files("crashes"))
def test_saved_input_is_refused_or_decoded(name, path):
    TARGETS[name](path.read_bytes())


@st.composite
def _mutated(draw, seeds: list[bytes]) -> bytes:
    """A seed with a few bytes flipped, inserted or deleted."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        edit = draw(st.sampled_from(["flip", "insert", "delete"]))
        if edit == "insert" or not data:
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif edit == "flip":
            data[min(at, len(data) - 1)] ^= 1 << draw(st.integers(0, 7))
        else:
            del data[at:at + draw(st.integers(1, 4))]
    return bytes(data)


@pytest.mark.parametrize("name", TARGETS)
@FEW
@given(data=st.data())
def test_target_takes_any_bytes(name, data):
    TARGETS[name](data.draw(st.binary(max_size=512)))


@pytest.mark.parametrize("name", TARGETS)
@FEW
@given(data=st.data())
def test_target_takes_mutated_seeds(name, data):
    TARGETS[name](data.draw(_mutated(_seeds(name))))
