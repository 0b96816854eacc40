"""minizero/deepspeed/adam.py: torch's Adam and AdamW, and DeepSpeed's bias_correction=False
step."""

from __future__ import annotations

import pytest
import torch

from minizero.deepspeed import adam

LR, BETAS, EPS, DECAY, STEPS = 0.01, (0.9, 0.99), 1e-8, 0.1, 5


def _gradients(step: int, shape=(7, 3)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(step))


def _trained(optimizer_class, **kwargs) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    p = torch.nn.Parameter(torch.linspace(-1, 1, 21).view(7, 3))
    optimizer = optimizer_class([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY, **kwargs)
    for step in range(STEPS):
        p.grad = _gradients(step)
        optimizer.step()
    return p.detach(), optimizer


def _uncorrected_by_hand(decoupled: bool) -> torch.Tensor:
    """The update DeepSpeed's fused and CPU Adam make with bias_correction false, element by
    element: m and v as Adam's, p -= lr·m/(√v + ε), no division by 1 - β^t."""
    p = torch.linspace(-1, 1, 21).view(7, 3).double()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step in range(STEPS):
        g = _gradients(step).double()
        if decoupled:
            p = p - LR * DECAY * p
        else:
            g = g + DECAY * p
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
        p = p - LR * m / (v.sqrt() + EPS)
    return p.float()


@pytest.mark.parametrize("ours, torchs", [(adam.Adam, torch.optim.Adam),
                                          (adam.AdamW, torch.optim.AdamW)])
def test_with_bias_correction_it_is_torchs_own_step_for_step(ours, torchs):
    mine, optimizer = _trained(ours)
    theirs, reference = _trained(torchs)
    assert torch.equal(mine, theirs)
    assert optimizer.state_dict()["state"][0].keys() == reference.state_dict()["state"][0].keys()


@pytest.mark.parametrize("ours, decoupled", [(adam.Adam, False), (adam.AdamW, True)])
def test_without_bias_correction_it_takes_deepspeeds_uncorrected_step(ours, decoupled):
    mine, _ = _trained(ours, bias_correction=False)
    assert torch.allclose(mine, _uncorrected_by_hand(decoupled), rtol=0, atol=1e-6)
    corrected, _ = _trained(ours)
    assert (mine - corrected).abs().max() > 1e-3            # the raw averages: smaller first steps

