"""ZeRO stage 2, P_os+g: stage 1, plus each rank keeps only its partition of the gradients.

    python -m minizero.run --stage 2 --world-size 4
    engine = minizero.wrap(model, 2, functools.partial(torch.optim.AdamW, lr=1e-3),
                           bucket_size=25e6)

What each rank holds (paper, section 5.2): parameters 2Ψ, gradients (2/N)Ψ, optimizer states KΨ/N:
2Ψ + (2 + K)Ψ/N bytes (16Ψ -> 2.2Ψ for Adam with N = 64).

Read zero1.py first: stage 2 is stage 1's row with the gradients family changed (P_g), this file's
GradientShard. A rank only ever *uses* its own partition of the gradient, so the parameters are
cut into buckets (flat.py), each partitioned over the N ranks; during backward each gradient is
copied into its bucket's staging buffer and freed the moment it is complete; a complete bucket is
reduce-scattered at once (reducer.GradBuckets, as in DDP), and when it arrives rank r adds its
partition into its gradient shard [Ψ/N], the only gradient memory that persists. Communication is
stage 1's, now overlapped with backward. Inside no_sync() gradients accumulate in full in p.grad
(2Ψ, as in FSDP); outside it every micro-batch is reduce-scattered into the shard (DeepSpeed's way).
"""

from __future__ import annotations

import torch

from minizero import comm, events
from minizero.flat import Bucket, FlatLayout


class GradientShard:
    """P_g: only this rank's partition of the gradients persists [Ψ/N]; each bucket is
    reduce-scattered during backward, as soon as it is complete."""
    in_backward = True                     # the engine's reducer calls reduce() inside backward
    # DeepSpeed's contiguous_gradients: each gradient staged when complete (off: exercise 6's)
    contiguous_gradients = True
    route = comm        # whose reduce_scatter runs: comm's (beyond/ brings other routes: ZeRO++)

    def __init__(self, engine, layout: FlatLayout, options=None):
        self.engine, self.layout, self.group = engine, layout, engine.group
        # [Ψ/N] in reduce_dtype; the staging buffers too: each gradient is upcast as it is staged
        self.shard = torch.zeros(layout.shard_numel, dtype=engine.grad_dtype, device=engine.device)
        self.staging: dict[int, torch.Tensor] = {}   # bucket index -> its full gradients, in flight
        self.on_grad = self.stage if self.contiguous_gradients else None
        self._offset = {p: off for b in layout.buckets for p, off in zip(b.params, b.offsets)}

    def _staging_buffer(self, b: Bucket) -> torch.Tensor:
        if b.index not in self.staging:                  # zeros: unused parameters reduce as zeros
            self.staging[b.index] = torch.zeros(
                b.padded_numel, dtype=self.shard.dtype, device=self.shard.device
            )
            events.emit("staging", engine=self.engine, bucket=b,
                        nbytes=self.staging[b.index].nbytes)
        return self.staging[b.index]                     # [Ψ_b padded]

    def stage(self, p, b: Bucket) -> None:
        """Inside backward, as soon as p's gradient is complete: move it into its bucket's staging
        buffer and free it (one full parameter gradient alive at a time, besides the buckets)."""
        if not self.engine.sync:
            return                                       # no_sync(): p.grad keeps accumulating
        self._staging_buffer(b)[self._offset[p]:][: p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None                                   # the full gradient freed at once

    def reduce(self, b: Bucket, tag: str | None = None):
        """Bucket b's gradients are complete: stage those not staged yet and start the
        reduce-scatter of the staging buffer; the handle (when it completes, arrived(b) adds this
        rank's partition into the shard). Inside no_sync() nothing (None). Stage 3's
        Unit.post_backward calls it; exercise 6's grader replaces it."""
        if not self.engine.sync:
            return None
        for p in b.params:         # not streamed in: accumulated under no_sync(), or contiguous off
            if p.grad is not None:
                self.stage(p, b)
        staging = self._staging_buffer(b)
        events.emit("bucket ready", engine=self.engine, bucket=b)  # buckets in flight: the peak
        mine = self.layout.my_partition(staging, b)
        # <- the essential line of stage 2: rank r receives the average of partition r
        return self.route.reduce_scatter(mine, staging, op="avg", async_op=True, group=self.group,
                                         tag=tag or f"bucket {b.index}")

    def arrived(self, b: Bucket) -> None:
        staging = self.staging.pop(b.index)
        events.emit("staging", engine=self.engine, bucket=b, nbytes=-staging.nbytes)
        self.layout.shard(self.shard, b).add_(self.layout.my_partition(staging, b))

    def parts(self) -> list[torch.Tensor]:
        return [self.layout.shard(self.shard, b) for b in self.layout.buckets]

    def zero(self) -> None:
        self.shard.zero_()

    def tensors(self, category: str) -> list[torch.Tensor]:
        return [self.shard, *self.staging.values()] if category == "grads" else []
