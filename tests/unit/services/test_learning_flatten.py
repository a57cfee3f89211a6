"""DiLoCo's in-place buffer: the parameters made views of one vector, or left alone."""

from __future__ import annotations

import torch

from meshd.services.learning.diloco import _flatten


def _params(model: torch.nn.Module) -> list:
    named = dict(model.named_parameters())
    return [named[n] for n in sorted(named)]


def test_parameters_become_views_of_one_vector_in_order_with_their_values():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params = _params(model)
    before = [p.detach().clone() for p in params]
    flat = _flatten(params)
    assert flat is not None and flat.numel() == sum(p.numel() for p in params)
    at = 0
    for p, value in zip(params, before):
        assert p.data_ptr() == flat[at:].data_ptr() and torch.equal(p, value)
        at += p.numel()
    flat.zero_()  # writing the vector writes the model
    assert all(not p.detach().any() for p in model.parameters())


def test_the_model_still_trains_after_its_parameters_moved():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    flat = _flatten(_params(model))
    before = flat.clone()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert not torch.equal(flat, before)  # the optimizer's update landed in the vector


def test_parameters_that_cannot_move_are_left_alone():
    shared = torch.nn.Linear(4, 4)
    shared.share_memory()
    base = torch.zeros(8)
    cases = {
        "half": list(torch.nn.Linear(2, 2).half().parameters()),
        "shared memory": list(shared.parameters()),
        "a view": [torch.nn.Parameter(base[:4]), torch.nn.Parameter(base[4:])],
        "one storage twice": [torch.nn.Parameter(base), torch.nn.Parameter(base)],
    }
    for why, params in cases.items():
        ptrs = [p.data_ptr() for p in params]
        assert _flatten(params) is None, why
        assert [p.data_ptr() for p in params] == ptrs, why
