"""ZeRO stage 1, P_os: each rank keeps optimizer states for 1/N of the parameters.

    python -m minizero.run --stage 1 --world-size 4
    engine = minizero.wrap(model, 1, functools.partial(torch.optim.AdamW, lr=1e-3))

What each rank holds (paper, section 5.1): parameters 2Ψ and gradients 2Ψ still replicated,
optimizer states KΨ/N: 4Ψ + KΨ/N bytes (16Ψ -> 4.19Ψ for Adam with N = 64). The optimizer states
were the biggest term (K = 12 of 16), and they are only ever *used* elementwise, so each rank can
own a partition.

Stage 1's row of the table (stages.py): DDP's replicated parameters (ddp.py), the optimizer given
this rank's partition (optim.py steps whatever it is given), and the one class this file adds.
Layout (flat.py): all trainable parameters in one bucket, padded to a multiple of N, cut into N
partitions; rank r owns partition r. Communication per step, 2Ψ(N-1)/N, the same as DDP (the
paper's point: P_os is free):
  * in step(): reduce-scatter the gradients, in place. Not an all-reduce: a rank only steps its
    partition, so it only needs *that* partition averaged, and a reduce-scatter is half an
    all-reduce (in bytes: on gloo comm.py runs it as one, [Note: collectives on gloo]).
  * after the optimizer step: all-gather the updated partitions (ddp.ReplicatedParameters).
Gradient accumulation is free: backward only adds into the full gradient buffer, reduced once at
the step. Why not reduce-scatter bucket by bucket during backward: a bucket reduced in place holds
the average in this rank's partition and local gradients elsewhere, so the next backward would add
into a mixed buffer; keeping the reduced partitions apart is exactly stage 2's gradient shard. So
stage 1's reduce-scatter waits at the step instead of hiding behind backward (docs/performance.md
measures the cost); stage 2 is the answer.
"""

from __future__ import annotations

import torch

from minizero import comm
from minizero.flat import FlatLayout


class GradientsReducedAtStep:
    """P_g off, ZeRO's way: every rank accumulates every gradient in one flat buffer; at the step
    each bucket is reduce-scattered, so that this rank holds the average of its partition."""
    in_backward = False              # nothing is sent during backward: no reducer
    on_grad = arrived = None

    def __init__(self, engine, layout: FlatLayout, options=None):
        self.layout, self.group = layout, engine.group
        # [padded Ψ] in reduce_dtype; p.grad are views of it (flat.point_grads_into)
        self.flat = torch.zeros(layout.padded_numel, dtype=engine.grad_dtype, device=engine.device)
        layout.point_grads_into(self.flat)

    def parts(self) -> list[torch.Tensor]:
        """At the start of step(): average this rank's partition over ranks, all it steps."""
        parts = []
        for b in self.layout.buckets:
            full = self.layout.full(self.flat, b)
            self.layout.reclaim_grads(b, full)                # after a zero_grad(): flat.py
            mine = self.layout.my_partition(full, b)
            comm.reduce_scatter(mine, full, op="avg", group=self.group,   # in place: mine gets
                                tag=f"bucket {b.index}")                  # the average
            parts.append(mine)
        return parts

    def zero(self) -> None:
        self.flat.zero_()

    def tensors(self, category: str) -> list[torch.Tensor]:
        return [self.flat] if category == "grads" else []
