"""Flatten, pad, partition: the one piece of bookkeeping every stage shares.

    python -m pytest tests/test_flat.py

ZeRO never communicates parameter by parameter. It lays parameters end to end in one 1-D buffer and
cuts that buffer into N equal *partitions* (N = world size, the paper's N_d), one per rank:

    flat buffer  |  p0 (6)  | p1 (4) |  p2 (5)  |pad|      numel Ψ_b = 15, padded to 16 for N = 4
    partitions   | rank 0 | rank 1 | rank 2 | rank 3 | 4 elements each; each p straddles two

A parameter may straddle two partitions (as in DeepSpeed); padding to a multiple of N lets
reduce-scatter and all-gather work on equal chunks. A `Bucket` is one such padded run; buckets sit
back to back in a layout (DDP and stage 2 send gradients bucket by bucket during backward; stage 3's
buckets are its units). A rank's *shard*: its partition of every bucket, end to end in one buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

DEFAULT_BUCKET_BYTES = 25e6      # PyTorch DDP's bucket_cap_mb = 25; used by DDP and stage 2


def partition(flat: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    """Piece `index` of a 1-D buffer cut into `parts` equal pieces, a view: "rank r's slice"."""
    size = flat.numel() // parts
    return flat[index * size: (index + 1) * size]


def padded_size(numel: int, parts: int) -> int:              # numel rounded up to N·⌈numel/N⌉
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
        """(param, its view shaped like it) for each parameter, into a buffer [padded_numel]."""
        for p, off in zip(self.params, self.offsets):
            yield p, bucket_buffer[off: off + p.numel()].view(p.shape)


@dataclass
class FlatLayout:
    """Buckets of parameters laid out back to back; one partition of each bucket per rank."""
    buckets: list[Bucket]
    world_size: int
    rank: int

    @classmethod
    def build(cls, buckets: list[list[nn.Parameter]], world_size: int, rank: int,
              pad: bool = True) -> "FlatLayout":
        """One Bucket per list of parameters; pad=False (DDP partitions nothing): no padding."""
        built, start, shard_start = [], 0, 0
        for i, params in enumerate(b for b in buckets if b):
            offsets, numel = [], 0
            for p in params:
                offsets.append(numel)
                numel += p.numel()
            padded = padded_size(numel, world_size) if pad else numel
            b = Bucket(params, offsets, numel, padded, start, shard_start,
                       world_size if pad else 1, i)
            built.append(b)
            start += padded
            shard_start += b.shard_numel
        return cls(built, world_size, rank)

    @property
    def numel(self) -> int:                  # Ψ: real parameter elements
        return sum(b.numel for b in self.buckets)

    @property
    def padded_numel(self) -> int:           # size of the flat buffer
        return sum(b.padded_numel for b in self.buckets)

    @property
    def shard_numel(self) -> int:            # size of one rank's shard buffer, ~Ψ / N
        return sum(b.shard_numel for b in self.buckets)

    @staticmethod
    def full(flat: torch.Tensor, b: Bucket) -> torch.Tensor:        # b's range of a flat buffer
        return flat[b.start: b.start + b.padded_numel]

    def my_partition(self, bucket_buffer: torch.Tensor, b: Bucket) -> torch.Tensor:
        """This rank's partition of a bucket's buffer [shard_numel]: a view, so collectives can
        work in place (reduce-scatter's output, all-gather's input)."""
        return partition(bucket_buffer, self.rank, b.world_size)

    @staticmethod
    def shard(shard_buffer: torch.Tensor, b: Bucket) -> torch.Tensor:   # b's part of the shard
        return shard_buffer[b.shard_start: b.shard_start + b.shard_numel]

    def flatten(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new flat buffer [padded_numel] of the parameters' values (padding zero)."""
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        for b in self.buckets:
            for p, view in b.views(self.full(flat, b)):
                view.copy_(p.detach())
        return flat

    @staticmethod
    def flatten_bucket(b: Bucket, dtype: torch.dtype, device: torch.device,
                       value_of=lambda p: p.detach()) -> torch.Tensor:
        """A new buffer [padded_numel] of one bucket holding value_of(p) of each parameter, the
        parameters made views of it (stage 3: a unit's full buffer)."""
        full = torch.zeros(b.padded_numel, dtype=dtype, device=device)
        for p, view in b.views(full):
            view.copy_(value_of(p))
            p.data = view
        return full

    def point_params_into(self, flat: torch.Tensor) -> None:
        """Make every parameter a view of `flat`: writing the buffer (an all-gather) updates the
        model. The parameters' old storage is freed once nothing else refers to it."""
        for b in self.buckets:
            for p, view in b.views(self.full(flat, b)):
                p.data = view

    def point_grads_into(self, flat_grads: torch.Tensor) -> None:
        """Backward accumulates into `flat_grads`: p.grad is a view of it, reduced without a copy
        (PyTorch DDP's gradient_as_bucket_view). In another dtype (reduce_dtype="fp32" under bf16)
        a hook, registered before the reducer's, adds each complete p.grad into its view instead."""
        for b in self.buckets:
            for p, view in b.views(self.full(flat_grads, b)):
                if view.dtype == p.dtype:
                    p.grad = view
                else:
                    p.register_post_accumulate_grad_hook(lambda p, v=view: _add_and_free(p, v))

    @staticmethod
    def reclaim_grads(b: Bucket, bucket_grads: torch.Tensor) -> None:
        """Before bucket b is reduced: each p.grad its view of `bucket_grads` again. The user's
        zero_grad() sets p.grad = None (torch's default), which detaches it from the buffer: the
        next backward makes a new tensor, which would not be reduced. So what autograd made is
        copied back (None: zero). Only where p.grad is a view (point_grads_into), not still one."""
        for p, view in b.views(bucket_grads):
            if view.dtype != p.dtype or p.grad is not None and p.grad.data_ptr() == view.data_ptr():
                continue
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
            p.grad = view


def _add_and_free(p: nn.Parameter, view: torch.Tensor) -> None:
    view.add_(p.grad)                  # upcasts: bf16 -> fp32
    p.grad = None


def split_into_buckets(params: list[nn.Parameter], bucket_bytes: float) -> list[list[nn.Parameter]]:
    """Greedy: consecutive parameters until a bucket holds at least `bucket_bytes`."""
    buckets, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


# --- the stages' bucket rules (stages.py: a column of the table) ----------------------------------
def by_size(trainable: list[nn.Parameter], bucket_bytes: float) -> list[list[nn.Parameter]]:
    """DDP and stage 2: buckets of about bucket_bytes in *reverse* parameter order, the order in
    which backward produces gradients: each can be sent while the rest of backward runs."""
    return split_into_buckets(list(reversed(trainable)), bucket_bytes)


def whole_model(trainable: list[nn.Parameter], bucket_bytes: float) -> list[list[nn.Parameter]]:
    """Stage 1: one bucket, the whole model (it is reduce-scattered once, at the step)."""
    return [trainable]
