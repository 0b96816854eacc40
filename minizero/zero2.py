"""ZeRO stage 2, P_os+g: stage 1, plus each rank keeps only its partition of the gradients.

    python -m minizero.run --stage 2 --world-size 4
    engine = minizero.wrap(model, 2, functools.partial(torch.optim.AdamW, lr=1e-3),
                           bucket_size=25e6)

What each rank holds (paper, section 5.2): parameters 2Ψ, gradients (2/N)Ψ, optimizer states KΨ/N:
2Ψ + (2 + K)Ψ/N bytes (16Ψ -> 2.2Ψ for Adam with N = 64).

Read zero1.py first: this file is only what stage 2 changes. Stage 1 kept a full gradient buffer
and reduce-scattered it after backward; but a rank only ever *uses* its own partition of the
gradient. So:
  * parameters are grouped into buckets (flat.py), each padded and partitioned over the N ranks;
  * during backward, each parameter's gradient is copied into its bucket's staging buffer and freed
    the moment it is complete; as soon as a bucket is complete (reducer.GradBuckets, the same
    mechanism as DDP) it is reduce-scattered asynchronously while backward continues;
  * when it arrives, rank r adds its partition into its gradient shard, the only gradient memory
    that persists: [Ψ/N]. Peak gradient memory is the shard plus the buckets in flight.
Communication is unchanged from stage 1 (reduce-scatter Ψ + all-gather Ψ = 2Ψ per step), now
overlapped with backward. Gradient accumulation: inside no_sync() gradients accumulate in full in
p.grad (no communication, but 2Ψ of gradient memory, as in FSDP's no_sync); outside it every
micro-batch is reduce-scattered and summed into the shard (DeepSpeed's way: more communication,
less memory).
reduce_dtype="fp32" (engine.py): staging buffers and shard are fp32, so the reduction and the
sum over micro-batches outside no_sync() are fp32; inside no_sync() p.grad accumulates in the
compute dtype.
quantized_gradients=True (ZeRO++ qgZ, quantize.py): the reduce-scatter becomes an all-to-all of int8
blocks, each rank averaging the N chunks it receives in fp32: Ψ(1 + 4/B) bytes instead of Ψ·2.
"""

from __future__ import annotations

import torch

from minizero import comm, events, quantize
from minizero.flat import DEFAULT_BUCKET_BYTES, Bucket, split_into_buckets
from minizero.reducer import GradBuckets
from minizero.zero1 import Zero1


class Zero2(Zero1):
    stage = 2
    # DeepSpeed's contiguous_gradients: copy each gradient into its bucket's staging buffer the
    # moment it is complete (one full parameter gradient alive at a time). Off, reduce_scatter_grads
    # stages the whole bucket at once (exercise 6's grader turns it off: the learner's hook does
    # exactly that).
    contiguous_gradients = True
    int8_codec = quantize.Int8Blocks   # ZeRO++'s codec (quantize.py); exercise 13 brings its own

    def __init__(self, model, optimizer, *, bucket_size: float = DEFAULT_BUCKET_BYTES,
                 buckets_in_flight: int = 2, quantized_gradients: bool = False,
                 quantization_block: int = quantize.BLOCK, **kwargs):
        self.bucket_size, self.buckets_in_flight = bucket_size, buckets_in_flight
        # qgZ
        self.quantized_gradients, self.quantization_block = quantized_gradients, quantization_block
        super().__init__(model, optimizer, **kwargs)

    def _param_groups(self):
        # Reverse parameter order: the order in which backward produces gradients, so buckets fill
        # up one after the other and can be sent while the rest of backward runs.
        return split_into_buckets(list(reversed(self.trainable)), self.bucket_size)

    # --- gradients: only this rank's partition persists -------------------------------------------
    def _init_gradients(self) -> None:
        # [Ψ/N] in reduce_dtype; the staging buffers too: each gradient is upcast as it is staged
        self.grad_shard = torch.zeros(
            self.layout.shard_numel, dtype=self.grad_dtype, device=self.device
        )
        self.staging: dict[int, torch.Tensor] = {}   # bucket index -> its full gradients, in flight
        # how a bucket's gradients travel: the shard group ([Note: hierarchical sharding]);
        # qgZ: int8
        codec = self.int8_codec(self.quantization_block) if self.quantized_gradients else comm.EXACT
        self.reduce_route = comm.Route(self.shard_group, codec)
        self.reducer = GradBuckets(
            self.layout.buckets,
            launch=self._bucket_ready,
            done=self._accumulate_bucket,
            on_grad=self._stage_gradient if self.contiguous_gradients else None,
            max_in_flight=self.buckets_in_flight,
            owner=self,
        )
        self._offset = {p: off for b in self.layout.buckets for p, off in zip(b.params, b.offsets)}

    def _staging_buffer(self, b) -> torch.Tensor:
        if b.index not in self.staging:                  # zeros: unused parameters reduce as zeros
            self.staging[b.index] = torch.zeros(
                b.padded_numel, dtype=self.grad_dtype, device=self.device
            )
            events.emit("staging", engine=self, bucket=b, nbytes=self.staging[b.index].nbytes)
        return self.staging[b.index]                     # [Ψ_b padded]

    def _stage_gradient(self, p, b) -> None:
        """Runs inside backward as soon as p's gradient is complete: move it into its
        bucket's staging buffer and free it, so at most one full parameter gradient exists
        besides the buckets."""
        if not self._sync:
            return                                       # no_sync(): p.grad keeps accumulating
        self._staging_buffer(b)[self._offset[p]:][: p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None                                   # <- the essential line: full gradient freed

    def _bucket_ready(self, b):
        """The reducer calls this inside backward once every gradient of bucket b is
        complete. Stage 3 overrides it: there a bucket is a unit, whose post-backward also
        frees its parameters."""
        return self.reduce_scatter_grads(b)

    def reduce_scatter_grads(self, b):
        """Bucket b's gradients are complete: stage them (those not staged yet), free every p.grad,
        and start the reduce-scatter that averages the staging buffer over ranks, rank r's partition
        receiving the average of partition r. Returns the async handle; when it completes,
        _accumulate_bucket adds that partition into grad_shard from self.staging[b.index]. Inside
        no_sync() nothing happens (None): gradients keep accumulating in p.grad.

        The seam others build on: stage 3's Unit.post_backward calls it, exercise 6's grader
        replaces it."""
        if not self._sync:
            return None
        for p in b.params:         # not streamed in: accumulated under no_sync(), or contiguous off
            if p.grad is not None:
                self._stage_gradient(p, b)
        staging = self._staging_buffer(b)
        events.emit("bucket ready", engine=self, bucket=b)    # buckets in flight: the gradient peak
        mine = self.layout.my_partition(staging, b)
        # averaged: rank r gets r
        return self.reduce_route.reduce_scatter(mine, staging, self.bucket_tag(b))

    def bucket_tag(self, b: Bucket) -> str:
        return f"bucket {b.index}"                     # what its collectives are for (event stream)

    def _accumulate_bucket(self, b) -> None:
        staging = self.staging.pop(b.index)
        events.emit("staging", engine=self, bucket=b, nbytes=-staging.nbytes)
        self.layout.shard(self.grad_shard, b).add_(self.layout.my_partition(staging, b))

    def _after_backward(self) -> None:
        self.reducer.finish()

    def _grad_parts(self):
        return [self.layout.shard(self.grad_shard, b) for b in self.layout.buckets]

    def _zero_grad(self) -> None:
        self.grad_shard.zero_()

    def _extra_tensors(self, category):
        return [self.grad_shard, *self.staging.values()] if category == "grads" else []
