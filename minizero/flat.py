"""Flatten, pad, partition: the one piece of bookkeeping every stage shares.

Run its tests:  python -m pytest tests/test_flat.py

ZeRO never communicates parameter by parameter. It lays parameters end to end in one 1-D buffer and
cuts that buffer into N equal *partitions* (N = world size, the paper's N_d), one per rank:

    flat buffer  |  p0 (6)  | p1 (4) |  p2 (5)  |pad|      numel Ψ_b = 15, padded to 16 for N = 4
    partitions   | rank 0 | rank 1 | rank 2 | rank 3 | 4 elements each; each p straddles two

A parameter may straddle two partitions (DeepSpeed's stage_1_and_2 does this; FairScale's OSS
instead assigns whole parameters to ranks, which balances worse). Padding the end to a multiple of N
is what lets reduce-scatter and all-gather work on equal chunks.

A `Bucket` is one such padded group. Several buckets can sit back to back in one buffer (DDP and
stage 2 bucket gradients so communication starts during backward; stage 3's buckets are its units).
Each rank's *shard* of a layout is the concatenation of its partition of every bucket, stored in one
contiguous buffer of `shard_numel` elements: that is where ZeRO keeps what it no longer replicates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

DEFAULT_BUCKET_BYTES = 25e6      # PyTorch DDP's bucket_cap_mb = 25; used by DDP and stage 2


def partition(flat: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    """Piece `index` of a 1-D buffer cut into `parts` equal pieces: [numel / parts], a view. The
    one rule for "rank r's slice" (of a bucket, of a collective's buffer, of hpZ's node group),
    used everywhere."""
    size = flat.numel() // parts
    return flat[index * size: (index + 1) * size]


def padded_size(numel: int, parts: int) -> int:
    """numel rounded up to a multiple of `parts`."""
    return -(-numel // parts) * parts


@dataclass(eq=False)          # buckets are compared and hashed by identity
class Bucket:
    params: list[nn.Parameter]
    offsets: list[int]       # where each parameter starts inside the bucket
    numel: int               # Ψ_b: elements of real parameters
    padded_numel: int        # numel rounded up to a multiple of N
    start: int               # where the bucket starts in the layout's flat buffer
    shard_start: int         # where this rank's partition of it starts in the layout's shard buffer
    world_size: int
    index: int = 0

    @property
    def shard_numel(self) -> int:            # one partition: padded_numel / N
        return self.padded_numel // self.world_size

    def views(self, bucket_buffer: torch.Tensor) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """(param, view shaped like param) for each parameter, into a buffer of
        padded_numel elements."""
        for p, off in zip(self.params, self.offsets):
            yield p, bucket_buffer[off: off + p.numel()].view(p.shape)


@dataclass
class FlatLayout:
    """Buckets of parameters laid out back to back; one partition of each bucket per rank."""
    buckets: list[Bucket]
    world_size: int
    rank: int

    @classmethod
    def build(cls, groups: list[list[nn.Parameter]], world_size: int, rank: int,
              pad: bool = True) -> "FlatLayout":
        """One bucket per group. pad=False (DDP, nothing is partitioned) keeps buckets unpadded."""
        buckets, start, shard_start = [], 0, 0
        for i, params in enumerate(g for g in groups if g):
            offsets, numel = [], 0
            for p in params:
                offsets.append(numel)
                numel += p.numel()
            padded = padded_size(numel, world_size) if pad else numel
            b = Bucket(
                params, offsets, numel, padded, start, shard_start, world_size if pad else 1, i
            )
            buckets.append(b)
            start += padded
            shard_start += b.shard_numel
        return cls(buckets, world_size, rank)

    # sizes ----------------------------------------------------------------------------------------
    @property
    def numel(self) -> int:                  # Ψ: real parameter elements
        return sum(b.numel for b in self.buckets)

    @property
    def padded_numel(self) -> int:           # size of the flat buffer
        return sum(b.padded_numel for b in self.buckets)

    @property
    def shard_numel(self) -> int:            # size of one rank's shard buffer, ~Ψ / N
        return sum(b.shard_numel for b in self.buckets)

    # slicing --------------------------------------------------------------------------------------
    @staticmethod
    def full(flat: torch.Tensor, b: Bucket) -> torch.Tensor:
        """Bucket b's range of a flat buffer: [padded_numel]."""
        return flat[b.start: b.start + b.padded_numel]

    def my_partition(self, bucket_buffer: torch.Tensor, b: Bucket) -> torch.Tensor:
        """This rank's partition of a full bucket buffer: [shard_numel]. A view, so collectives can
        work in place (reduce-scatter's output, all-gather's input)."""
        return partition(bucket_buffer, self.rank, b.world_size)

    @staticmethod
    def shard(shard_buffer: torch.Tensor, b: Bucket) -> torch.Tensor:
        """Bucket b's part of this rank's shard buffer: [shard_numel]."""
        return shard_buffer[b.shard_start: b.shard_start + b.shard_numel]

    # moving parameters in and out -----------------------------------------------------------------
    def flatten(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new flat buffer [padded_numel] holding the parameters' current values
        (padding zero)."""
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        for b in self.buckets:
            for p, view in b.views(self.full(flat, b)):
                view.copy_(p.detach())
        return flat

    @staticmethod
    def flatten_bucket(b: Bucket, dtype: torch.dtype, device: torch.device,
                       value_of=lambda p: p.detach()) -> torch.Tensor:
        """A new buffer [padded_numel] of one bucket, holding value_of(p) of each parameter (padding
        zero), and the parameters made views of it (stage 3: a unit's full buffer)."""
        full = torch.zeros(b.padded_numel, dtype=dtype, device=device)
        for p, view in b.views(full):
            view.copy_(value_of(p))
        FlatLayout.point_bucket_into(b, full)
        return full

    def unit_buffers(self, b: Bucket | None, shard: torch.Tensor | None, dtype: torch.dtype,
                     device: torch.device, value_of) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 3's unit: its full buffer [padded_numel] (flatten_bucket: the parameters views of
        it) and `shard` [shard_numel] given this rank's partition of it; empty ones for no b (a
        bucket of this layout or one with the same N and rank)."""
        if b is None:
            empty = torch.empty(0, dtype=dtype, device=device)
            return empty, empty
        full = FlatLayout.flatten_bucket(b, dtype, device, value_of)
        return full, shard.copy_(self.my_partition(full, b))

    def point_params_into(self, flat: torch.Tensor) -> None:
        """Make every parameter a view of `flat`: writing the buffer (an all-gather) updates the
        model. The parameters' old storage is freed once nothing else refers to it."""
        for b in self.buckets:
            self.point_bucket_into(b, self.full(flat, b))

    @staticmethod
    def point_bucket_into(b: Bucket, bucket_buffer: torch.Tensor) -> None:
        for p, view in b.views(bucket_buffer):
            p.data = view

    def point_grads_into(self, flat_grads: torch.Tensor) -> None:
        """Make backward accumulate the gradients into `flat_grads`.

        Same dtype as the parameters: p.grad becomes a view of `flat_grads`, so autograd accumulates
        straight into the flat buffer (PyTorch DDP's gradient_as_bucket_view) and the buffer can be
        reduced without a copy. Another dtype (engine's reduce_dtype="fp32" for bf16/fp16
        parameters): a p.grad must have its parameter's dtype, so autograd produces it as usual and
        a hook adds it into its (fp32) view the moment it is complete, then frees it: the sum over
        backwards happens in fp32. The hook is registered first, so it runs before a reducer's
        (reducer.GradBuckets) sees the gradient complete."""
        for b in self.buckets:
            for p, view in b.views(self.full(flat_grads, b)):
                if view.dtype == p.dtype:
                    p.grad = view
                else:
                    p.register_post_accumulate_grad_hook(
                        lambda p, view=view: _add_and_free(p, view)
                    )


    @staticmethod
    def reclaim_grads(b: Bucket, bucket_grads: torch.Tensor) -> None:
        """Before bucket b's gradients are reduced: make each p.grad its view of `bucket_grads`
        again. PyTorch's zero_grad() sets p.grad = None (set_to_none=True, torch's default since
        2.0; Hugging Face's Trainer calls model.zero_grad() every step), which detaches it from the
        buffer: the next backward then makes a new tensor, and the buffer would be reduced without
        it (at stage 1 the parameters stopped moving). So what autograd made is copied back, and a
        gradient the user dropped (None) is zero. Only where p.grad is a view (point_grads_into);
        the fp32-reduce hooks add into the buffer whatever p.grad is."""
        start, size = bucket_grads.data_ptr(), bucket_grads.element_size()
        for p, offset in zip(b.params, b.offsets):
            grad = p.grad
            if p.dtype != bucket_grads.dtype or (
                    grad is not None and grad.data_ptr() == start + offset * size):
                continue                      # added by a hook, or still its view: nothing to do
            view = bucket_grads[offset: offset + p.numel()].view(p.shape)
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
            p.grad = view


def _add_and_free(p: nn.Parameter, view: torch.Tensor) -> None:
    view.add_(p.grad)                  # upcasts: bf16 -> fp32
    p.grad = None


def split_into_buckets(params: list[nn.Parameter], bucket_bytes: float) -> list[list[nn.Parameter]]:
    """Greedy: consecutive parameters until a bucket holds at least `bucket_bytes`."""
    groups, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


# --- the stages' bucket rules (stages.py: a column of the table) ----------------------------------
def by_size(trainable: list[nn.Parameter], bucket_bytes: float) -> list[list[nn.Parameter]]:
    """DDP and stage 2: buckets of about bucket_bytes in *reverse* parameter order, the order in
    which backward produces gradients, so buckets fill up one after the other and can be sent while
    the rest of backward runs."""
    return split_into_buckets(list(reversed(trainable)), bucket_bytes)


def whole_model(trainable: list[nn.Parameter], bucket_bytes: float) -> list[list[nn.Parameter]]:
    """Stage 1: one bucket, the whole model (it is reduce-scattered once, at the step)."""
    return [trainable]
