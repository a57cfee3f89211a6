"""An expert from files (meshd.services.experts.loading): a factory's module, weights loaded without unpickling."""

import textwrap

import pytest
import torch
from safetensors.torch import save_file

from meshd.services.experts.loading import LoadError, load_module, parse_factory

FACTORY = textwrap.dedent('''
    import torch

    def make(width=3):
        return torch.nn.Linear(4, width)

    class Models:
        @staticmethod
        def broken():
            raise RuntimeError("no GPU here")
''')


@pytest.fixture
def factory(tmp_path):
    path = tmp_path / "tinymodels.py"
    path.write_text(FACTORY)
    return path


class Evil:
    def __reduce__(self):
        return (print, ("ran code while loading",))


def test_weights_from_safetensors_or_a_weights_only_torch_file_go_into_the_factorys_module(tmp_path, factory):
    torch.manual_seed(0)
    want = torch.nn.Linear(4, 5)
    save_file(want.state_dict(), tmp_path / "w.safetensors")
    torch.save({"state_dict": want.state_dict()}, tmp_path / "w.pt")
    x = torch.randn(2, 4)
    for weights in ("w.safetensors", "w.pt"):
        module = load_module(f"{factory}:make", str(tmp_path / weights), kwargs={"width": 5})
        assert not module.training and torch.equal(module(x), want(x))
    by_name = load_module("tinymodels:make", None, search=[str(tmp_path)])  # a dotted module, found in search
    assert isinstance(by_name, torch.nn.Linear) and by_name.out_features == 3


def test_what_cannot_give_a_module_is_a_load_error_saying_why(tmp_path, factory, capsys):
    torch.save({"weight": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(LoadError, match="weights-only"):
        load_module(f"{factory}:make", str(tmp_path / "evil.pt"))
    assert "ran code" not in capsys.readouterr().out  # nothing was unpickled
    torch.save(torch.nn.Linear(4, 3).state_dict(), tmp_path / "small.pt")
    with pytest.raises(LoadError, match="do not fit"):
        load_module(f"{factory}:make", str(tmp_path / "small.pt"), kwargs={"width": 7})
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(LoadError, match="not a readable .safetensors"):
        load_module(f"{factory}:make", str(tmp_path / "junk.safetensors"))
    with pytest.raises(LoadError, match="no GPU here"):
        load_module(f"{factory}:Models.broken")
    with pytest.raises(LoadError, match="has no 'nothing'"):
        load_module(f"{factory}:nothing")
    with pytest.raises(LoadError, match="absolute path"):
        load_module("relative/models.py:make")
    with pytest.raises(LoadError, match="importing 'no_such_module_here' failed"):
        load_module("no_such_module_here:make")
    with pytest.raises(LoadError, match="MODULE:NAME"):
        parse_factory("just-a-name")
    with pytest.raises(LoadError, match="no weights file"):
        load_module(f"{factory}:make", str(tmp_path / "missing.pt"))
