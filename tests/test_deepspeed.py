"""minizero against DeepSpeed's ZeRO (stages 1, 2, 3 and 2 + optimizer offload, N = 2): the same
small GPT (tied embedding/head, a frozen parameter, an unused one, odd sizes; AdamW with weight
decay) ends at the same parameters, and each rank holds the same bytes of Adam moments up to
padding. One launch runs all four configurations, DeepSpeed inside minizero.launch's process group
(minizero/lab/deepspeed_peer.py says how, and how its JIT build is avoided). Skipped when DeepSpeed
is not installed: pip install -e ".[peers]" (CI installs it).
Run: python -m pytest tests/test_deepspeed.py -q"""

from __future__ import annotations

import functools

import pytest
import torch

import minizero
from minizero.flat import padded_size
from minizero.lab import deepspeed_peer
from minizero.deepspeed.config import load_deepspeed_config
from minizero.lab.model import make_model
from minizero.lab.reference import max_abs_diff
from minizero.lab.train import TrainConfig, train_worker
from minizero.wrap import wrap

pytestmark = pytest.mark.skipif(
    not deepspeed_peer.available(),
    reason="DeepSpeed is not installed (DS_BUILD_OPS=0 pip install -e '.[peers]')",
)

N = 2
# n_embd 15 makes most parameters odd-sized, so both sides must pad (differently, see below). The
# unused parameter's gradient is zero on both sides, so weight decay moves it on both (reducer.py)
BASE = {
    "world_size": N,
    "steps": 5,
    "lr": 1e-2,
    "optimizer_params": {"weight_decay": 0.1},
    "backend": "gloo",
    "return_state": True,
    "model": "tiny",
    "model_overrides": {"n_embd": 15, "frozen": ("pos_emb.weight",), "unused_param": True},
}
CONFIGS = {
    "stage 1": TrainConfig(stage=1, **BASE),
    "stage 2": TrainConfig(stage=2, **BASE),
    "stage 3": TrainConfig(stage=3, **BASE),
    "stage 2 + offload": TrainConfig(stage=2, offload=True, **BASE),
}


def both_sides(cfgs: list[TrainConfig]) -> list[dict]:
    """Worker: per configuration, minizero's run and DeepSpeed's, their difference and their
    moments; and whether torch.nn.functional.linear is still torch's own afterwards."""
    linear = torch.nn.functional.linear
    out = []
    for cfg in cfgs:
        # minizero first: a DeepSpeed run that changed torch for the rest of the process (as its
        # stage 3 does with memory_efficient_linear, see deepspeed_peer.ds_config) could not hide
        # behind the next run
        engines = []
        mz = train_worker(cfg, make_engine=functools.partial(_kept, engines))
        ds = deepspeed_peer.deepspeed_worker(cfg)
        layout = engines[0].layout
        out.append({"max_param_diff": max_abs_diff(mz["state_dict"], ds["state_dict"]),
                    "losses": (mz["losses"], ds["losses"]),
                    "moments": (deepspeed_peer.adam_moment_bytes(engines[0].optimizer.optimizer),
                                ds["adam_moment_bytes"]),
                    "layout": (layout.numel, layout.padded_numel),
                    "linear_untouched": torch.nn.functional.linear is linear})
    return out


def _kept(engines: list, *args, **kwargs):
    """minizero.wrap, keeping the engine (for its optimizer and layout after the run)."""
    engines.append(wrap(*args, **kwargs))
    return engines[-1]


@pytest.fixture(scope="module")
def runs():
    per_rank = minizero.launch(both_sides, N, list(CONFIGS.values()), backend="gloo", timeout=300)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(CONFIGS)}


@pytest.mark.parametrize("name", CONFIGS)
def test_same_parameters_as_deepspeed(runs, name):
    for rank in runs[name]:
        # fp32, AdamW, no clipping on either side: bitwise equal today (0.0); 1e-6 leaves room
        # for rounding
        assert rank["max_param_diff"] <= 1e-6, (name, rank["max_param_diff"])
        ours, theirs = rank["losses"]
        assert ours == pytest.approx(theirs, abs=1e-6), name


@pytest.mark.parametrize("name", CONFIGS)
def test_same_adam_moments_per_rank_up_to_padding(runs, name):
    cfg = CONFIGS[name]
    model = make_model(cfg.model_config())
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]      # the tied weight once
    psi = sum(sizes)                                                         # Ψ: trainable elements
    # Both sides keep exp_avg and exp_avg_sq (4 + 4 bytes) for one partition of the padded
    # trainables. minizero pads each bucket (stage 3: each unit) to a multiple of N
    # (flat.padded_size). DeepSpeed stages 1-2 flatten everything into one group padded to a
    # multiple of 2N (its nccl_start_alignment_factor 2: fp16 partitions start 4-byte aligned);
    # stage 3 partitions every parameter on its own, each padded to a multiple of N
    # (ds_tensor = ceil(numel / N) elements).
    ds_padded = sum(padded_size(n, N) for n in sizes) if cfg.stage == 3 else padded_size(psi, 2 * N)
    for rank in runs[name]:
        numel, padded = rank["layout"]
        ours, theirs = rank["moments"]
        assert numel == psi
        assert ours == 8 * padded // N and theirs == 8 * ds_padded // N, (name, ours, theirs)
        # equal exactly once each side's padding is taken out (summed over the N equal partitions)
        assert N * ours - 8 * (padded - psi) == N * theirs - 8 * (ds_padded - psi) == 8 * psi
    if cfg.stage == 3:
        assert ds_padded > padded, "per-parameter padding: DeepSpeed pads more than minizero here"


def test_deepspeed_leaves_torch_as_it_found_it(runs):
    # The bench runs every side in the same processes, one after another: a peer that swapped a
    # torch function process-wide would change the numerics (and the timing) of every run after it,
    # minizero's included.
    assert all(rank["linear_untouched"] for ranks in runs.values() for rank in ranks)


def test_the_peer_config_reads_back_as_the_run():
    for cfg in CONFIGS.values():
        overrides, _ = load_deepspeed_config(deepspeed_peer.ds_config(cfg), N)
        assert (
            overrides["stage"],
            bool(overrides.get("offload")),
            overrides["clip_grad_norm"],
        ) == (cfg.stage, bool(cfg.offload), cfg.clip_grad_norm), (
            overrides
        )  # None: off on both sides
        assert overrides["batch_size"] == cfg.batch_size and overrides["grad_accum"] == 1
