"""The training loop the ensembles' helpers share: its learning-rate decay."""

import pytest
import torch

from experts.training import fit


def moved(steps: int, decay: float, lr: float = 0.01) -> float:
    """How far ``fit`` moves one weight whose loss has a constant gradient: Adam takes a step of
    the learning rate (its normalised gradient is 1), so the distance is the sum of the rates."""
    weight = torch.nn.Parameter(torch.zeros(()))
    model = torch.nn.Module()
    model.weight = weight
    fit(model, steps, lr, 0, lambda gen: weight * 1.0, decay=decay)
    return -float(weight.detach())


def test_the_rate_is_constant_then_falls_linearly_to_zero_over_the_last_fraction_of_the_steps():
    assert moved(10, 0.0) == pytest.approx(0.10, rel=1e-3)
    # decay 0.5 over 10 steps: 1 for steps 0-5, then 0.8, 0.6, 0.4, 0.2
    assert moved(10, 0.5) == pytest.approx(0.01 * (6 + 0.8 + 0.6 + 0.4 + 0.2), rel=1e-3)
    assert moved(4, 1.0) == pytest.approx(0.01 * (1 + 0.75 + 0.5 + 0.25), rel=1e-3)


def test_a_decay_outside_0_to_1_is_refused():
    with pytest.raises(ValueError, match="decay"):
        fit(torch.nn.Linear(1, 1), 1, 0.01, 0, lambda gen: torch.zeros(()), decay=1.5)
