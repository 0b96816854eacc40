"""Stage 3's units: activation checkpointing recomputes a unit's forward inside backward, and the
default units of a model without transformer blocks stay a fraction of it.

    python -m pytest tests/test_zero3_units.py
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import minizero
from minizero import comm
from minizero.lab.demo import unit_timeline
from minizero.lab.model import GPT, make_model
from minizero.lab.train import TrainConfig, forward_backward
from _checks import assert_matches_reference

# How a block's forward is recomputed in backward (torch.utils.checkpoint). Hugging Face's
# gradient_checkpointing_enable() is "non-reentrant": it checkpoints each decoder layer's __call__,
# the unit's hooks included. Early stop (PyTorch's default) ends the recomputation as soon as the
# tensors backward needs exist, before the block's forward returns; without it the forward runs to
# its end.
CHECKPOINTING = ("non-reentrant", "non-reentrant, no early stop", "reentrant")


class Checkpointed(nn.Module):
    """minizero's GPT computed with every block under torch.utils.checkpoint, in one of
    CHECKPOINTING's modes."""

    def __init__(self, gpt: GPT, mode: str):
        super().__init__()
        self.gpt, self.mode = gpt, mode

    def forward(self, idx: torch.Tensor) -> torch.Tensor:         # GPT.forward, blocks checkpointed
        gpt, T = self.gpt, idx.shape[1]
        x = gpt.tok_emb(idx) + gpt.pos_emb(torch.arange(T, device=idx.device))
        for block in gpt.blocks:
            with set_checkpoint_early_stop(self.mode != "non-reentrant, no early stop"):
                x = checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return gpt.head(gpt.ln_f(x))


def train_checkpointed(runs: list[tuple[TrainConfig, str]]) -> list[dict]:
    """Worker: stage 3 on Checkpointed(GPT) for each (config, mode); the last step's
    gather/free timeline."""
    out = []
    for cfg, mode in runs:
        model = Checkpointed(make_model(cfg.model_config(), seed=cfg.seed), mode)
        engine = minizero.wrap(
            model, 3, cfg.optimizer_factory(), offload=cfg.offload, **cfg.engine_options()
        )
        for step in range(cfg.steps):
            with unit_timeline(engine) as timeline:
                forward_backward(cfg, step, engine, engine.backward, engine.no_sync)
                engine.step()
        state = {
            name.removeprefix("gpt."): value for name, value in engine.full_state_dict().items()
        }
        out.append({"rank": comm.rank(), "state_dict": state, "unit_names": engine.unit_names,
                    "events": [(event, b) for _, event, b in timeline]})
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_activation_checkpointing_trains_like_the_reference(n):
    base = TrainConfig(stage=3, world_size=n, steps=3, batch_size=12, grad_accum=2, model="tiny",
                       optimizer="sgd", lr=0.5)
    runs = [(base, mode) for mode in CHECKPOINTING]
    if n == 2:
        runs.append((dataclasses.replace(base, offload="params"), "non-reentrant, no early stop"))
    per_rank = minizero.launch(train_checkpointed, n, runs)
    for i, (cfg, mode) in enumerate(runs):
        results = [rank_results[i] for rank_results in per_rank]
        assert_matches_reference(cfg, results, atol=1e-6)
        # Recomputing gathers nothing again: two gathers and two frees per unit and micro-batch.
        for b, name in enumerate(results[0]["unit_names"]):
            events = [e for e, u in results[0]["events"] if u == b]
            gathers = [e for e in events if e in ("gather", "prefetch")]
            assert len(gathers) == 2 * cfg.grad_accum, f"{mode}, unit {name}: {events}"
            assert events.count("free") == 2 * cfg.grad_accum, f"{mode}, unit {name}: {events}"


# --- default units --------------------------------------------------------------------------------
def _units(model: nn.Module, **options) -> list[tuple[nn.Module, bool, float]]:
    """(module, whether it owns only parameters it holds directly, share of the trainable
    parameters) for each unit of a one-rank engine. (Never put a stage-3 parameter in a message: its
    storage is freed.)"""
    engine = minizero.wrap(model, 3, functools.partial(torch.optim.SGD, lr=0.1), **options)
    modules = {name or "<root>": m for name, m in model.named_modules()}
    out = []
    for name, b in zip(engine.unit_names, [unit.bucket for unit in engine.units]):
        own = {id(p) for p in modules[name].parameters(recurse=False)}
        out.append((modules[name], {id(p) for p in b.params} <= own, b.numel / engine.layout.numel))
    return out


def _mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


MODELS = {   # no nn.ModuleList among them: default units by size
    "sequential": lambda: nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]),
    "nested": lambda: nn.Sequential(
        nn.Embedding(100, 32),
        nn.Sequential(*[_mlp(32) for _ in range(6)]),
        nn.LayerNorm(32),
        nn.Linear(32, 100),
    ),
    "one_big_weight": lambda: nn.Sequential(nn.Embedding(2000, 32), *[_mlp(32) for _ in range(3)]),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_default_units_hold_at_most_an_eighth_of_any_model(name):
    for module, only_its_own, share in _units(MODELS[name]()):
        # the one exception: parameters a module holds directly (here the big embedding) are
        # never split
        assert share <= 1 / 8 or only_its_own, f"{module}: {share:.0%} of the model"


def test_default_units_of_a_transformer_are_its_blocks():
    model = make_model(TrainConfig(model="tiny").model_config())
    assert [module for module, _, _ in _units(model)] == [model, *model.blocks]   # forward order


def test_given_units_that_leave_one_unit_most_of_the_model_warn():
    model = make_model(TrainConfig().model_config())
    with pytest.warns(UserWarning, match=r"unit '<root>' holds 100% of the parameters.*units="):
        _units(model, units=[])
    model = make_model(TrainConfig().model_config())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _units(model, units=list(model.blocks))


def sequential_peaks(width: int) -> list[dict]:
    """Worker: peak parameter bytes of an 8-layer nn.Sequential of Linear(width, width) under stage
    3's default units, with and without prefetch (two steps each)."""
    out = []
    for prefetch in (False, True):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(8)])
        engine = minizero.wrap(
            model, 3, functools.partial(torch.optim.SGD, lr=0.1), prefetch=prefetch
        )
        for _ in range(2):
            engine.backward(engine(torch.randn(4, width)).square().mean())
            engine.step()
        out.append(engine.memory()["peak_params"])
    return out


def test_default_units_keep_the_peak_of_a_sequential_near_one_layer():
    width, n = 256, 4
    no_prefetch, prefetch = minizero.launch(sequential_peaks, n, width)[0]
    layer = (width * width + width) * 4                  # bytes of one Linear, fp32
    shard = 8 * layer / n                                # Ψ/N
    assert no_prefetch <= shard + 1.1 * layer            # one layer gathered at a time ...
    assert prefetch <= shard + 2.1 * layer < 8 * layer   # ... and the next one prefetched
