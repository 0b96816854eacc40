"""Stage 3's units: activation checkpointing recomputes a unit's forward inside backward.

    python -m pytest tests/test_zero3_units.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import minizero
from minizero import comm
from minizero.model import GPT, make_model
from minizero.train import TrainConfig, forward_backward
from _checks import assert_matches_reference

# How a block's forward is recomputed in backward (torch.utils.checkpoint). Hugging Face's
# gradient_checkpointing_enable() is "non-reentrant": it checkpoints each decoder layer's __call__, the
# unit's hooks included. Early stop (PyTorch's default) ends the recomputation as soon as the tensors
# backward needs exist, before the block's forward returns; without it the forward runs to its end.
CHECKPOINTING = ("non-reentrant", "non-reentrant, no early stop", "reentrant")


class Checkpointed(nn.Module):
    """minizero's GPT computed with every block under torch.utils.checkpoint, in one of CHECKPOINTING's modes."""

    def __init__(self, gpt: GPT, mode: str):
        super().__init__()
        self.gpt, self.mode = gpt, mode

    def forward(self, idx: torch.Tensor) -> torch.Tensor:          # GPT.forward, blocks checkpointed
        gpt, T = self.gpt, idx.shape[1]
        x = gpt.tok_emb(idx) + gpt.pos_emb(torch.arange(T, device=idx.device))
        for block in gpt.blocks:
            with set_checkpoint_early_stop(self.mode != "non-reentrant, no early stop"):
                x = checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return gpt.head(gpt.ln_f(x))


def train_checkpointed(runs: list[tuple[TrainConfig, str]]) -> list[dict]:
    """Worker: stage 3 on CheckpointedGPT for each (config, mode); the last step's gather/free timeline."""
    out = []
    for cfg, mode in runs:
        model = Checkpointed(make_model(cfg.model_config(), seed=cfg.seed), mode)
        engine = minizero.wrap(model, 3, cfg.optimizer_factory(), offload=cfg.offload, **cfg.engine_options())
        for step in range(cfg.steps):
            engine.timeline = [] if step == cfg.steps - 1 else None
            forward_backward(cfg, step, engine, engine.backward, engine.no_sync)
            engine.step()
        state = {name.removeprefix("gpt."): value for name, value in engine.full_state_dict().items()}
        out.append({"rank": comm.rank(), "state_dict": state, "unit_names": engine.unit_names,
                    "events": [(event, b) for _, event, b in engine.timeline]})
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
