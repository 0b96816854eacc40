"""Exercise 6: ZeRO stage 2, reduce-scatter a bucket of gradients from inside backward.

    Grade it:    pytest exercises -k ex06            (or: python -m minizero.grade -k ex06)
    Notebook:    notebooks/03_zero2.ipynb
    Compare:     minizero/zero2.py (GradientShard: reduce, arrived), minizero/reducer.py
                 (minizero goes one step further: GradientShard.stage copies each gradient into
                 the bucket the moment it is complete, so a bucket's full gradients never all
                 exist at once)

Stage 2 (P_os+g) adds gradient partitioning to stage 1: a rank only ever *uses* the averaged
gradient of its own partition, so it need not keep the others: b_pΨ + (b_g + K)Ψ/N bytes (b_p, b_g:
bytes of a parameter and of a gradient; K: the optimizer's per parameter). The paper's bf16 Adam:
2Ψ + 14Ψ/N; fp32 AdamW, as notebook 03 runs (K = 8): 4Ψ + 12Ψ/N; this grader's fp32 plain SGD (no
state, K = 0): 4Ψ + 4Ψ/N. Parameters are grouped in buckets (as in DDP, in backward order), each
bucket padded to a multiple of N and cut into N partitions. As soon as backward has produced every
gradient of a bucket, minizero calls your hook, which must:

  1. copy the bucket's gradients end to end into a new zero-filled *staging* buffer of
     `padded_numel` elements (parameter i starts where parameter i-1 ends; a parameter whose .grad
     is None got no gradient this step, an unused one: it contributes zeros);
  2. free the full gradients, p.grad = None: this is the memory stage 2 saves;
  3. start an asynchronous reduce-scatter that *averages* the staging buffer over ranks, rank r's
     partition staging[r*n:(r+1)*n] (n = padded_numel / N) receiving the average of that partition;
  4. return (staging, handle).

While backward goes on computing the next bucket's gradients, the network works on this one. When
the handle completes, minizero adds partition r of your staging buffer into the rank's gradient
shard [Ψ/N], the only gradient memory that persists.

What the grader checks: three ranks train a small GPT for 3 SGD steps with minizero's stage 2
calling your hook for every bucket, and must end where one process training on the whole batch ends;
after each hook the bucket's p.grad must be None; the staging buffer must have padded_numel
elements.

Hints:
  * comm.reduce_scatter(output, input, op=..., async_op=True) may work in place: `output` can be
    rank r's slice of `input`.
  * Make the staging buffer with the gradients' dtype and device (params[0].dtype, comm.device()).
"""

import torch
from torch import nn

from minizero import comm  # noqa: F401  (your answer will need it)


def reduce_scatter_bucket(params: list[nn.Parameter],
                          padded_numel: int) -> tuple[torch.Tensor, object]:
    """Stage the bucket's gradients, free them, start averaging partition r onto rank r; (staging,
    handle)."""
    raise NotImplementedError("ex06: write reduce_scatter_bucket")
