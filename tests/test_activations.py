"""ZeRO-R's activations (minizero/beyond/activations.py): measured next to memory.activation_bytes,
cut by checkpointing, and every stage trained with checkpointing ends where the single-process
reference does.

    python -m pytest tests/test_activations.py
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch import nn

import minizero
from minizero.beyond.activations import MODES
from minizero.lab.data import global_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import TrainConfig, loss_fn, train_several
from minizero.memory import activation_bytes
from _checks import AWKWARD, assert_matches_reference

# (GPT overrides, micro-batch rows): width, heads, sequence and batch all vary.
SIZES = [(dict(), 8), (dict(n_embd=32, n_head=2, block_size=16), 4),
         (dict(n_layer=6, n_embd=48, n_head=3, block_size=24), 6)]


def measured_activations(overrides: dict, rows: int, mode, stage: int = 0) -> int:
    """engine.memory()["activations"] after one forward and backward on one process."""
    model = make_model(GPTConfig(**overrides))
    engine = minizero.wrap(
        model, stage, functools.partial(torch.optim.SGD, lr=0.1), activation_checkpointing=mode
    )
    x, y = global_batch(0, rows, model.cfg.block_size)
    engine.backward(loss_fn(engine(x), y))
    return engine.memory()["activations"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("overrides, rows", SIZES)
def test_measured_activations_match_the_estimate(overrides, rows, mode):
    cfg = GPTConfig(**overrides)
    estimate = activation_bytes(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, rows,
                                mlp_ratio=cfg.mlp_ratio, checkpointing=mode)
    got = measured_activations(overrides, rows, mode)
    assert abs(got - estimate) <= 0.1 * estimate, (
        f"measured {got} bytes, estimated {estimate:.0f} ({mode=})"
    )


def test_an_unknown_checkpointing_mode_is_refused_before_anything_is_built():
    with pytest.raises(
        ValueError, match="activation_checkpointing must be False, True, 'cpu', 'partitioned' or "
                          "'partitioned\\+cpu', got 'gpu'"
    ):
        minizero.wrap(
            nn.Linear(4, 4),
            3,
            functools.partial(torch.optim.SGD, lr=0.1),
            activation_checkpointing="gpu",
        )


def test_checkpointing_cuts_the_activations_of_a_4_block_gpt_by_more_than_half():
    kept, checkpointed, on_host = (measured_activations({}, 8, mode, stage=3) for mode in MODES)
    assert checkpointed <= 0.5 * kept, f"{checkpointed} of {kept} bytes kept with checkpointing"
    assert on_host < checkpointed, "cpu checkpointing keeps the blocks' inputs on the device"


class Gate(nn.Module):
    """Linear, then the product of its output's two halves: mul saves two views of one storage."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h[:, :4] * h[:, 4:]


def test_the_meter_counts_each_storage_once_without_parameters_until_backward_uses_it():
    engine = minizero.wrap(Gate(), 0, functools.partial(torch.optim.SGD, lr=0.1))
    out = engine(torch.randn(5, 8))          # saved: x [5, 8] and h [5, 8] once; not the weight
    assert engine.memory()["activations"] == 2 * 5 * 8 * 4
    engine.backward(out.sum())
    assert engine.activations.alive == 0, "backward used every saved tensor: none is alive"


class DropoutBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.drop = nn.Linear(16, 16), nn.Dropout(0.5)

    def forward(self, x, mask):                       # mask: None here, a non-tensor input
        return x + self.drop(torch.tanh(self.lin(x)))


class DropoutStack(nn.Module):
    """Blocks with dropout: the recompute must draw the same masks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(DropoutBlock() for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x, None)
        return x


def test_checkpointing_recomputes_dropout_exactly_and_passes_non_tensor_inputs():
    grads = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = DropoutStack()
        engine = minizero.wrap(
            model, 0, functools.partial(torch.optim.SGD, lr=0.1), activation_checkpointing=mode
        )
        torch.manual_seed(1)
        engine.backward(engine(torch.randn(8, 16)).square().sum())
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    for mode in (True, "cpu"):
        assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[mode])), (
            f"{mode=}: other gradients"
        )


# --- every stage with checkpointing, against the reference ----------------------------------------
# (stage, activation_checkpointing, offload): each stage with both modes, offload at stages 1-3.
SETTINGS = [
    (0, True, False),
    (1, True, False),
    (1, "cpu", True),
    (2, "cpu", False),
    (2, True, "optimizer"),
    (3, True, False),
    (3, "cpu", "params"),
]


@pytest.mark.parametrize("n", [2, 3])
def test_checkpointing_trains_like_the_reference_at_every_stage(n):
    base = TrainConfig(
        world_size=n, steps=3, batch_size=12, grad_accum=2, optimizer="sgd", lr=0.5, **AWKWARD
    )
    cfgs = [dataclasses.replace(base, stage=s, activation_checkpointing=mode, offload=offload)
            for s, mode, offload in SETTINGS]
    cfgs = [dataclasses.replace(c, return_state=True) for c in cfgs]
    per_rank = minizero.launch(train_several, n, cfgs)
    for i, cfg in enumerate(cfgs):
        assert_matches_reference(cfg, [rank_results[i] for rank_results in per_rank], atol=1e-6)


def test_the_peak_breakdown_names_what_neither_count():
    """scripts/peak_breakdown.py at stage 0, fp32 (docs/gpus.md): its columns are torch's
    categories in torch's order, and at the step's peak the profiler's model states are exactly
    engine.memory()'s. What neither engine.memory() nor the activation meter counts is then
    autograd's gradients in flight plus the batch, less the saved activations backward has freed
    by then: all three are there, and the rest of the profiler's bytes are no more than what the
    meter counts."""
    import pathlib
    import sys
    from torch.profiler import _memory_profiler
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "scripts"))
    import peak_breakdown
    assert [c.name.lower().replace("_", " ") if c else "unknown"
            for c in _memory_profiler._CATEGORY_TO_INDEX] == list(peak_breakdown.COLUMNS)
    r = minizero.launch(peak_breakdown.breakdown, 1, 0, "fp32", 8)[0]
    p = r["profiler"]
    assert p["parameter"] + p["gradient"] + p["optimizer state"] == r["model_states"], r
    assert p["autograd detail"] > 0 and p["input"] > 0, p            # inside backward, batch alive
    assert 0 < p["activation"] < r["activations"], r                 # some saved ones already freed
    assert r["peak"] > r["model_states"] + r["activations"], r       # neither counts: > 0
