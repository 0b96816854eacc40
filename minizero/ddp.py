"""Stage 0: distributed data parallel (DDP), the baseline ZeRO improves on.

    python -m minizero.run --stage 0 --world-size 4
    engine = minizero.wrap(model, 0, functools.partial(torch.optim.AdamW, lr=1e-3))

What each rank holds: *everything*. Parameters 2Ψ, gradients 2Ψ, optimizer states KΨ (bf16 + Adam:
(2 + 2 + 12)Ψ = 16Ψ bytes), on every one of the N ranks. Only the data is split: each rank computes
gradients on its own B/N rows, and the average over ranks is the gradient of the global batch (the
mean of N equal-sized means). Communication per step: one all-reduce, 2Ψ(N-1)/N in a ring.

DDP is the first row of the table (stages.py): both families at their baseline, reused below it.
PyTorch DDP's design, reduced to its essentials: rank 0's weights are broadcast (engine.py);
parameters and gradients live in flat buffers, cut into buckets in *reverse* parameter order (the
order backward produces gradients); autograd writes gradients straight into the flat buffer; a
complete bucket's all-reduce starts at once (reducer.GradBuckets), overlapping the rest of
backward; every rank then takes the same optimizer step on the same averaged gradients.
"""

from __future__ import annotations

import torch

from minizero import comm
from minizero.flat import Bucket, FlatLayout


class ReplicatedParameters:
    """P_p off (stages 0-2): every rank holds every parameter, end to end in one flat buffer (the
    model's parameters are views of it). The optimizer steps all of it (DDP) or this rank's
    partition (stages 1-2), which are then all-gathered."""

    def __init__(self, engine, buckets: list[list], options=None):
        # N partitions; DDP partitions nothing, so no padding: its tally is exactly 2(N-1)/N·Ψ
        self.layout = FlatLayout.build(buckets, comm.group_size(engine.group),
                                       comm.group_rank(engine.group), pad=engine.sharded)
        self.partitioned, self.group = engine.sharded, engine.group
        self.flat = self.layout.flatten(engine.dtype, engine.device)  # [Ψ padded to N·⌈Ψ/N⌉]
        self.layout.point_params_into(self.flat)
        self.model_params = engine.model_params

    def bucket(self, b: Bucket) -> torch.Tensor:
        return self.layout.full(self.flat, b)                                       # [Ψ_b]

    def optimizer_parts(self) -> list[torch.Tensor]:
        """What the optimizer steps, per bucket: all of it, or this rank's partition [Ψ_b / N]
        (views: the step updates the parameters in place)."""
        if not self.partitioned:
            return [self.bucket(b) for b in self.layout.buckets]
        return [self.layout.my_partition(self.bucket(b), b) for b in self.layout.buckets]

    def bucket_ready(self, b: Bucket, reduce):
        return reduce(b)                  # inside backward: nothing happens to the parameters

    def after_step(self) -> None:
        if not self.partitioned:
            return                                 # DDP: replicas took identical steps
        for b in self.layout.buckets:
            full = self.bucket(b)
            comm.all_gather(full, self.layout.my_partition(full, b), group=self.group,
                            tag=f"bucket {b.index}")                       # in place: mine is input

    def before_backward(self) -> None:
        pass

    def after_backward(self) -> None:
        pass

    def param_tensors(self) -> list[torch.Tensor]:
        return self.model_params

    def tensors(self, category: str) -> list[torch.Tensor]:
        return []                                # the model's parameters are counted already


class AllReducedGradients:
    """P_g off, DDP's way: every rank keeps every gradient; each bucket is all-reduced (averaged
    over ranks) during backward, as soon as it is complete."""
    in_backward = True                     # the engine's reducer calls reduce() inside backward
    on_grad = arrived = None

    def __init__(self, engine, layout: FlatLayout, options=None):
        self.engine, self.layout = engine, layout
        # [Ψ] in reduce_dtype; p.grad are views of it (FlatLayout.point_grads_into)
        self.flat = torch.zeros(layout.padded_numel, dtype=engine.grad_dtype, device=engine.device)
        layout.point_grads_into(self.flat)

    def bucket(self, b: Bucket) -> torch.Tensor:
        return self.layout.full(self.flat, b)                                       # [Ψ_b]

    def reduce(self, b: Bucket, tag: str | None = None):
        if not self.engine.sync:
            return None                                  # no_sync(): keep accumulating locally
        self.layout.reclaim_grads(b, self.bucket(b))    # after a zero_grad(): flat.py
        # the essential line of DDP: this bucket's average over ranks, while backward goes on
        return comm.all_reduce(self.bucket(b), op="avg", async_op=True,
                               group=self.engine.group, tag=tag or f"bucket {b.index}")

    def parts(self) -> list[torch.Tensor]:
        return [self.bucket(b) for b in self.layout.buckets]

    def zero(self) -> None:
        self.flat.zero_()

    def tensors(self, category: str) -> list[torch.Tensor]:
        return [self.flat] if category == "grads" else []
