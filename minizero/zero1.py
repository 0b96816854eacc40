"""ZeRO stage 1, P_os: each rank keeps optimizer states for 1/N of the parameters.

    python -m minizero.run --stage 1 --world-size 4
    engine = minizero.wrap(model, 1, functools.partial(torch.optim.AdamW, lr=1e-3))

What each rank holds (paper, section 5.1): parameters 2Ψ and gradients 2Ψ still replicated,
optimizer states KΨ/N: 4Ψ + KΨ/N bytes (16Ψ -> 4.75Ψ for Adam with N = 64). The optimizer states
were the biggest term (K = 12 of 16), and they are only ever *used* elementwise, so each rank can
own a partition.

Layout (flat.py): all trainable parameters end to end in one flat buffer, padded to a multiple of
N, cut into N equal partitions; rank r owns partition r (a parameter may straddle two ranks, as
in DeepSpeed).

Communication per step, 2Ψ·(N-1)/N in a ring, the same as DDP (the paper's point: P_os is free):
  * in step(): reduce-scatter the gradients. Not an all-reduce: a rank only steps its partition, so
    it only needs *that* partition averaged, and reduce-scatter is exactly half of an all-reduce (Ψ;
    in bytes: on gloo comm.py runs it as an all-reduce, faster there, [Note: collectives on gloo]).
    It runs in place: rank r's partition of its full gradient buffer receives the average.
  * after the optimizer step: all-gather the updated partitions into every rank's parameters (Ψ).
Stage 1 keeps it simple: one reduce-scatter per step, no overlap with backward (stage 2 adds that).
Gradient accumulation is free: backward only adds into the full gradient buffer, so any number of
micro-batches (inside no_sync() or not) are reduced together, once, at the step.
Why not reduce-scatter bucket by bucket during backward, as DDP and stage 2 do: it needs stage 2's
layout (a partition in every bucket; stage 1 has one bucket), and a bucket reduce-scattered in place
holds the average in this rank's partition but local gradients everywhere else, so a second backward
before the step would add into a mixed buffer; keeping the reduced partitions apart from the buffer
backward adds into is exactly stage 2's gradient shard. So stage 1 pays knowingly: its
reduce-scatter (Ψ(N-1)/N per rank) waits at the step instead of hiding behind backward, where
DDP + ZeroRedundancyOptimizer overlaps its all-reduce (twice the bytes): docs/performance.md
measures what that costs. Stage 2 is the answer when it matters.
"""

from __future__ import annotations

import torch

from minizero import comm
from minizero.disk import DiskShardOptimizer
from minizero.engine import Engine
from minizero.flat import FlatLayout
from minizero.offload import HostShardOptimizer
from minizero.optim import ShardOptimizer


class Zero1(Engine):
    stage = 1

    def __init__(self, model, optimizer, **kwargs):
        super().__init__(model, optimizer, **kwargs)
        # N partitions, or S with shard_group_size: [Note: hierarchical sharding] in engine.py
        self.layout = FlatLayout.build(self._param_groups(), comm.group_size(self.shard_group),
                                       comm.group_rank(self.shard_group))
        self._init_parameters()
        self._init_gradients()
        self.optimizer = self._make_optimizer([self._my_params(b) for b in self.layout.buckets])

    def _param_groups(self):
        return [self.trainable]                          # one bucket: the whole model

    # --- parameters: full and replicated, as in DDP -----------------------------------------------
    def _init_parameters(self) -> None:
        self.flat_params = self.layout.flatten(self.dtype, self.device)    # [Ψ padded to N·⌈Ψ/N⌉]
        self.layout.point_params_into(self.flat_params)

    def _make_optimizer(self, parts):
        grouping = self._grouping()              # the parameter groups' runs in my partitions
        if self.offload == "disk":
            return DiskShardOptimizer(parts, self.optimizer_factory, self.offload_path, grouping)
        cls = HostShardOptimizer if self.offload else ShardOptimizer
        # <- the essential line: it sees Ψ/N parameters
        return cls(parts, self.optimizer_factory, grouping)

    def _my_params(self, b) -> torch.Tensor:
        """This rank's partition of bucket b's parameters: [Ψ_b / N], a view into flat_params."""
        return self.layout.my_partition(self.layout.full(self.flat_params, b), b)

    # --- gradients: full and replicated, as in DDP ------------------------------------------------
    def _init_gradients(self) -> None:
        # [padded Ψ] in reduce_dtype; p.grad are views of it, or added into it
        # (flat.point_grads_into)
        self.flat_grads = torch.zeros_like(self.flat_params, dtype=self.grad_dtype)
        self.layout.point_grads_into(self.flat_grads)

    def _after_backward(self) -> None:
        pass                      # gradients just accumulate in flat_grads: any number of backwards

    def _grad_parts(self):
        """At the start of step(): average this rank's partition over ranks, the only part
        it steps."""
        parts = []
        for b in self.layout.buckets:
            full = self.layout.full(self.flat_grads, b)
            mine = self.layout.my_partition(full, b)
            comm.reduce_scatter(mine, full, op="avg", group=self.shard_group,  # in place: mine gets
                                tag=f"bucket {b.index}")                   # the average
            parts.append(mine)
        return parts

    def _zero_grad(self) -> None:
        self.flat_grads.zero_()

    # --- after the step: every rank needs every updated parameter ---------------------------------
    def _after_step(self) -> None:
        for b in self.layout.buckets:
            full = self.layout.full(self.flat_params, b)
            comm.all_gather(full, self.layout.my_partition(full, b), group=self.shard_group,
                            tag=f"bucket {b.index}")                       # in place: mine is input

    def _extra_tensors(self, category):
        return [self.flat_grads] if category == "grads" else []
