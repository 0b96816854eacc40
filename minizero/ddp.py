"""Stage 0: distributed data parallel (DDP), the baseline ZeRO improves on.

    python -m minizero.run --stage 0 --world-size 4
    engine = minizero.wrap(model, 0, functools.partial(torch.optim.AdamW, lr=1e-3))

What each rank holds: *everything*. Parameters 2Ψ, gradients 2Ψ, optimizer states KΨ (bf16 + Adam:
(2 + 2 + 12)Ψ = 16Ψ bytes), on every one of the N ranks. Only the data is split: each rank computes
gradients on its own B/N rows, and averaging the gradients over ranks gives exactly the gradient of
the global batch (the mean of N equal-sized means is the global mean).

Communication per step: one all-reduce of the gradients, 2Ψ·(N-1)/N elements in a ring.

How (PyTorch DDP's design, reduced to its essentials):
  1. at construction, rank 0's weights are broadcast (Engine) so all replicas start equal;
  2. parameters and gradients are laid out in flat buffers, split into buckets in *reverse*
     parameter order, roughly the order in which backward produces gradients;
  3. autograd writes gradients straight into the flat gradient buffer (p.grad is a view of it);
  4. as soon as a bucket's gradients are all written, its all-reduce starts asynchronously
     (reducer.GradBuckets), overlapping the rest of backward;
  5. step: every rank runs the same optimizer step on the same averaged gradients, so replicas
     stay equal.
Inside `engine.no_sync()` backward only accumulates into the buffer; the next synced backward
reduces it. `overlap=False` launches every bucket after backward instead (step 4 off): the baseline
that shows, under a network model (minizero/network.py), how much communication the overlap hides.
"""

from __future__ import annotations

import torch

from minizero import comm
from minizero.engine import Engine
from minizero.flat import DEFAULT_BUCKET_BYTES, FlatLayout, split_into_buckets
from minizero.optim import ShardOptimizer
from minizero.reducer import GradBuckets


class DDP(Engine):
    stage = 0
    sharded = False                 # every rank steps all parameters

    def __init__(
        self,
        model,
        optimizer,
        *,
        bucket_size: float = DEFAULT_BUCKET_BYTES,
        overlap: bool = True,
        buckets_in_flight: int = 2,
        **kwargs,
    ):
        super().__init__(model, optimizer, **kwargs)
        groups = split_into_buckets(list(reversed(self.trainable)), bucket_size)
        # Nothing is partitioned, so buckets need no padding: the tally is exactly 2(N-1)/N·Ψ.
        self.layout = FlatLayout.build(groups, self.world_size, self.rank, pad=False)
        self.flat_params = self.layout.flatten(self.dtype, self.device)    # [Ψ]
        self.layout.point_params_into(self.flat_params)
        # [Ψ] in reduce_dtype; p.grad are views of it, or added into it (fp32 reduce:
        # flat.point_grads_into)
        self.flat_grads = torch.zeros_like(self.flat_params, dtype=self.grad_dtype)
        self.layout.point_grads_into(self.flat_grads)
        self.reducer = GradBuckets(self.layout.buckets, launch=self._all_reduce_bucket, owner=self,
                                   max_in_flight=buckets_in_flight, overlap=overlap)
        self.optimizer = ShardOptimizer([self._bucket_params(b) for b in self.layout.buckets],
                                        self.optimizer_factory, self._grouping())

    def _bucket_params(self, b):
        return self.layout.full(self.flat_params, b)

    def _bucket_grads(self, b):
        return self.layout.full(self.flat_grads, b)

    # --- backward: runs inside autograd, once per bucket ------------------------------------------
    def _all_reduce_bucket(self, b):
        if not self._sync:
            return None                                  # no_sync(): keep accumulating locally
        for p, view in b.views(self._bucket_grads(b)):
            # autograd replaced p.grad:
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)                       # put it back into the bucket
                p.grad = view
        # the essential line of DDP: this bucket's average over ranks, while backward goes on
        return comm.all_reduce(self._bucket_grads(b), op="avg", async_op=True,
                               group=self.shard_group, tag=f"bucket {b.index}")

    def _after_backward(self) -> None:
        self.reducer.finish()

    # --- step -------------------------------------------------------------------------------------
    def _grad_parts(self):
        return [self._bucket_grads(b) for b in self.layout.buckets]

    def _after_step(self) -> None:
        pass                                       # replicas took identical steps: nothing to share

    def _zero_grad(self) -> None:
        self.flat_grads.zero_()

    def _extra_tensors(self, category):
        return [self.flat_grads] if category == "grads" else []
