"""ZeRO stage 1, P_os: each rank keeps optimizer states for 1/N of the parameters.

    python -m minizero.run --stage 1 --world-size 4
    engine = minizero.wrap(model, 1, functools.partial(torch.optim.AdamW, lr=1e-3))

What each rank holds (paper, section 5.1): parameters 2Ψ and gradients 2Ψ still replicated,
optimizer states KΨ/N: 4Ψ + KΨ/N bytes (16Ψ -> 4.19Ψ for Adam with N = 64). The optimizer states
were the biggest term (K = 12 of 16), and they are only ever *used* elementwise, so each rank can
own a partition.

Stage 1's row of the table (stages.py): DDP's replicated parameters (ddp.py), the optimizer given
this rank's partition, and the one class this file adds. All trainable parameters are one bucket
(flat.py), cut into N partitions; rank r owns partition r (torch's ZeroRedundancyOptimizer gives
ranks whole parameters: docs/pytorch.md). Per step, 2Ψ(N-1)/N as in DDP (P_os is free):
  * in step(): reduce-scatter the gradients, in place. A rank only steps its partition, so it only
    needs *that* partition averaged: half an all-reduce (on gloo comm.py runs it as one).
  * after the optimizer step: all-gather the updated partitions (ddp.ReplicatedParameters).
Gradient accumulation is free: backward only adds into the full gradient buffer. Reducing bucket
by bucket during backward instead would leave the average in this rank's partition and local
gradients elsewhere, for the next backward to add into: keeping the two apart is stage 2's shard.
"""

from __future__ import annotations

import torch

from minizero import comm
from minizero.ddp import AllReducedGradients


class GradientsReducedAtStep(AllReducedGradients):
    """P_g off, ZeRO's way: every rank accumulates every gradient in one flat buffer, as in DDP;
    at the step each bucket is reduce-scattered, so that this rank holds the average of its
    partition."""
    in_backward = False              # nothing is sent during backward: no reducer

    def parts(self) -> list[torch.Tensor]:
        """At the start of step(): average this rank's partition over ranks, all it steps."""
        parts = []
        for b in self.layout.buckets:
            full = self.bucket(b)
            self.layout.reclaim_grads(b, full)                # after a zero_grad(): flat.py
            mine = self.layout.my_partition(full, b)
            # <- the essential line of stage 1: in place, mine receives the average of mine
            comm.reduce_scatter(mine, full, op="avg", group=self.engine.group,
                                tag=f"bucket {b.index}")
            parts.append(mine)
        return parts
