"""ZeRO++ qwZ and qgZ (minizero/beyond/quantize.py): the error bound of int8 block quantization, the
bytes each quantized collective sends (= memory.comm_volume), one step's error within the bound,
and convergence."""

from __future__ import annotations

import functools

import pytest
import torch

import minizero
from minizero.beyond import quantize
from minizero.cli.run import main as run_main
from minizero.deepspeed.config import load_deepspeed_config
from minizero.lab.quantized import LR, PSI, VARIANTS, quantized_experiment
from minizero.lab.train import TrainConfig
from minizero.memory import comm_volume

N, BLOCK = 3, 16


# --- quantize / dequantize, no processes ----------------------------------------------------------

@pytest.mark.parametrize("shape,block", [((1000,), 64), ((3, 50), 16), ((7,), 256)])
def test_error_is_at_most_half_a_scale(shape, block):
    x = torch.randn(shape) * torch.logspace(-3, 2, shape[-1])   # blocks of very different magnitude
    q, scales = quantize.quantize(x, block)
    assert q.dtype == torch.int8 and q.shape == x.shape
    # the tail block padded, not dropped
    assert scales.shape == (*shape[:-1], -(-shape[-1] // block))
    err = (x - quantize.dequantize(q, scales, block)).abs()
    bound = quantize.error_bound(scales, shape[-1], block)
    assert (err <= bound).all(), f"error {(err - bound).max():.3g} above absmax/254"
    assert (bound <= x.abs().max() / 254 * 1.001).all()   # and the bound is absmax/254 of the block


def test_multiples_of_the_scale_and_zeros_come_back_exactly():
    scale = 0.25
    # 255 + 20
    x = torch.cat([torch.arange(-127, 128, dtype=torch.float32) * scale, torch.zeros(20)])
    q, scales = quantize.quantize(x, 255)
    assert scales.tolist() == [scale, 0.0]                       # a block of zeros: scale 0, no NaN
    assert torch.equal(quantize.dequantize(q, scales, 255), x)


def test_wire_bytes_and_single_rank_collectives():
    assert quantize.wire_bytes(1000, 64) == 1000 + 4 * 16          # Ψ int8 + 4 bytes per block
    assert quantize.wire_bytes(PSI, BLOCK) == PSI + 4 * PSI // BLOCK
    x = torch.randn(100)
    expected = quantize.dequantize(*quantize.quantize(x, 8), 8)
    gathered, averaged = torch.empty(100), x.clone()
    quantize.all_gather(gathered, x, 8)
    quantize.reduce_scatter(averaged, averaged, 8)                   # in place, as stage 2 calls it
    assert torch.equal(gathered, expected) and torch.equal(averaged, expected)


def test_quantized_options_only_where_they_apply():
    opt = functools.partial(torch.optim.SGD, lr=0.1)
    with pytest.raises(
        TypeError, match="stage 2 does not take option.s. quantized_weights .only stage 3."
    ):
        minizero.wrap(torch.nn.Linear(4, 4), 2, opt, quantized_weights=True)
    with pytest.raises(TypeError, match="stage 1 does not take option.s. quantized_gradients"):
        minizero.wrap(torch.nn.Linear(4, 4), 1, opt, quantized_gradients=True)
    with pytest.raises(ValueError, match="quantization_block"):
        minizero.wrap(torch.nn.Linear(4, 4), 2, opt, quantized_gradients=True, quantization_block=0)
    assert run_main(["--stage", "2", "--quantized-weights"]) == 2
    # DeepSpeed's keys
    zero = {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True}
    overrides, warnings = load_deepspeed_config({"zero_optimization": zero}, 2)
    assert overrides["quantized_weights"] and overrides["quantized_gradients"] and not warnings


# --- one launch at N = 3: bytes, one step's error, training ---------------------------------------

RUNS = {"stage 3": {}, "stage 3 qwZ+qgZ": {"quantized_weights": True, "quantized_gradients": True},
        "stage 2 qgZ": {"quantized_gradients": True}}


@pytest.fixture(scope="module")
def experiment():
    cfgs = [
        TrainConfig(
            stage=int(name[6]), world_size=N, steps=12, model="tiny", batch_size=12, **options
        )
        for name, options in RUNS.items()
    ]
    return minizero.launch(quantized_experiment, N, cfgs, BLOCK)[0]


@pytest.mark.parametrize("name", VARIANTS)
def test_bytes_sent_equal_the_formula(experiment, name):
    stage, options = VARIANTS[name]
    tally = experiment["one_step"][name]["tally"]
    formula = comm_volume(PSI, N, stage, bytes_per_elem=4, block=BLOCK, **options)
    assert tally["total"] == pytest.approx(formula, abs=1e-9), tally
    if options.get("quantized_gradients"):                 # the reduce-scatter became an all-to-all
        assert "reduce_scatter" not in tally and tally["all_to_all"] == (
            N - 1
        ) / N * quantize.wire_bytes(PSI, BLOCK)


def test_qwz_forward_weights_within_the_bound_backward_exact(experiment):
    """qwZ: forward computes with w' = dequantize(quantize(w)), |w' - w| <= absmax/254 of w's block
    (at most max|w| / 254); backward's gather is exact."""
    ran = experiment["one_step"]["stage 3 qwZ"]
    exact = [experiment["initial"][f"{i}.weight"] for i in (0, 2, 4)]
    for w, fwd, bwd in zip(exact, ran["forward"], ran["backward"]):
        err = (fwd - w).abs().max().item()
        assert 0 < err <= w.abs().max().item() / 254 * 1.001, err
        assert torch.equal(bwd, w)


@pytest.mark.parametrize("stage", [2, 3])
def test_qgz_one_step_error_within_the_bound(experiment, stage):
    """qgZ, one SGD step: each rank's chunk of its gradient g_r is off by at most absmax/254 of its
    block, so the average over ranks by at most max_r |g_r| / 254, and the parameters after the step
    by lr times that."""
    plain = experiment["one_step"][f"stage {stage}"]["state"]
    quantized = experiment["one_step"][f"stage {stage} qgZ"]["state"]
    bound = LR * experiment["grad_max"] / 254 * 1.001 + 1e-7
    err = max((plain[k] - quantized[k]).abs().max().item() for k in plain)
    assert 0 < err <= bound, f"one step's error {err:.3g}, bound {bound:.3g}"


def test_quantized_training_converges_like_unquantized(experiment):
    runs = dict(zip(RUNS, experiment["runs"]))
    plain = runs["stage 3"]["losses"]
    for name in ("stage 3 qwZ+qgZ", "stage 2 qgZ"):
        losses = runs[name]["losses"]
        assert losses[-1] < 0.9 * losses[0], (name, losses)
        # measured: 0.002
        assert abs(losses[-1] - plain[-1]) <= 0.01 * plain[0], (name, losses[-1], plain[-1])
