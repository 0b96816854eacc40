"""Grader for exercise 13 (ZeRO++'s block quantization):  pytest exercises -k ex13

(1) In this process: your quantize/dequantize on tensors with blocks of very different magnitudes, a
partial last block and a block of zeros; each element must come back within absmax/254 of its block.
(2) The adapter: minizero.beyond.quantize.all_gather and reduce_scatter (what qwZ and qgZ send,
zero3.py and zero2.py) call the module's quantize and dequantize; in the launched ranks those two
names are pointed at yours. Two ranks train a small GPT at stage 3 with quantized_weights and
quantized_gradients, with yours and with minizero's: the bytes sent per step (comm.tally) must be
the same, n + 4 ceil(n/B) per chunk.
"""

import math

import pytest
import torch

import _grading as g
from minizero import comm
from minizero.beyond import quantize
from minizero.lab.train import train_worker
from minizero.assembled import Zero3

BLOCK = 16
CFG = g.config(stage=3, world_size=2, steps=2, optimizer="adamw", lr=1e-3, quantized_weights=True,
               quantized_gradients=True)


def samples() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    # 50 = 3 blocks of 16 + a block of 2
    rows = torch.randn(3, 50) * torch.logspace(-4, 2, 50)
    zeros = torch.cat([torch.randn(20), torch.zeros(16), torch.randn(5)])
    return {
        "rows [3, 50]": rows,
        "with a block of zeros [41]": zeros,
        "shorter than a block [7]": torch.randn(7),
    }


def check_error_bound(impl: str) -> None:
    __tracebackhide__ = True
    g.guard(impl)
    answer = g.learner(impl)
    for name, x in samples().items():
        n, blocks = x.shape[-1], math.ceil(x.shape[-1] / BLOCK)
        q, scales = g.call(answer.quantize, x, BLOCK)
        if tuple(q.shape) != tuple(x.shape) or tuple(scales.shape) != (*x.shape[:-1], blocks):
            raise AssertionError(f"{name}: quantize returned q {tuple(q.shape)} and scales "
                                 f"{tuple(scales.shape)}, expected {tuple(x.shape)} and "
                                 f"{(*x.shape[:-1], blocks)} (one scale per block of {BLOCK}, the "
                                 "last one shorter)")
        back = g.call(answer.dequantize, q, scales, BLOCK)
        if not torch.isfinite(back).all():
            raise AssertionError(f"{name}: dequantize(quantize(x)) holds nan or inf: a block of "
                                 "zeros has scale 0, divide by 1 there")
        padded = torch.nn.functional.pad(x.abs(), (0, blocks * BLOCK - n)).view(
            *x.shape[:-1], blocks, BLOCK
        )
        # absmax/254 per element
        bound = (padded.amax(-1) / 254).repeat_interleave(BLOCK, -1)[..., :n]
        err = (back.float() - x).abs()
        excess = err - bound * (1 + 1e-4) - 1e-12
        if (excess > 0).any():
            i = int(excess.reshape(-1).argmax())
            ratio = err.reshape(-1)[i] / bound.reshape(-1)[i]
            raise AssertionError(f"{name}: element {i} is {x.reshape(-1)[i].item():.6g}, "
                                 f"dequantize(quantize(x)) gave {back.reshape(-1)[i].item():.6g}: "
                                 f"an error of {ratio.item():.3g} x absmax/254 of its block, more "
                                 "than rounding to the nearest of 255 levels allows. scale = "
                                 "absmax / 127?")


def run(codec=quantize.Int8Blocks) -> dict:
    class Engine(Zero3):
        int8_codec = codec          # the engine's ZeRO++ codec (zero2.py, beyond/quantize.py)

    def build(model, stage, optimizer, **options):
        return Engine(model, optimizer, **options)
    result = train_worker(CFG, make_engine=build)
    return {"bytes": result["comm_bytes_per_step"], "losses": result["losses"]}


def worker(module_name: str) -> dict:
    answer = g.learner(module_name)

    class Yours(quantize.Int8Blocks):          # minizero's collectives, your quantize / dequantize
        @staticmethod
        def quantize(x, block):
            return g.call(answer.quantize, x, block)

        @staticmethod
        def dequantize(q, scales, block):
            return g.call(answer.dequantize, q, scales, block)
    return {"rank": comm.rank(), "yours": run(Yours), "minizero": run()}


def check_bytes(impl: str) -> None:
    __tracebackhide__ = True
    g.guard(impl)
    for res in g.launch_once(worker, CFG.world_size, impl):
        yours, ref = res["yours"]["bytes"], res["minizero"]["bytes"]
        for kind in ("all_to_all", "all_gather"):
            if yours.get(kind) != ref.get(kind):
                what = (
                    "the gradients' all-to-all (qgZ)"
                    if kind == "all_to_all"
                    else "the all-gathers (qwZ + backward)"
                )
                raise AssertionError(f"rank {res['rank']}: {what} sent {yours.get(kind)} bytes in "
                                     f"the last step with your quantize, {ref.get(kind)} with "
                                     "minizero's: q must be int8 (1 byte an element) and scales "
                                     "one fp32 per block, n + 4 ceil(n/B) bytes a chunk")
        if not all(math.isfinite(x) for x in res["yours"]["losses"]):
            raise AssertionError(f"rank {res['rank']}: losses {res['yours']['losses']} with your "
                                 "quantization")


@pytest.mark.points(2)
def test_error_is_within_half_a_quantization_step(impl):
    check_error_bound(impl)


@pytest.mark.points(1)
def test_quantized_stage3_sends_the_formulas_bytes(impl):
    check_bytes(impl)
