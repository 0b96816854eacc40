"""Hierarchical sharding (FSDP2's HSDP, DeepSpeed's MiCS): partition within groups of S ranks,
replicate across them.

    engine = minizero.wrap(model, 2, optimizer, shard_group_size=2)      # stages 1-3
    python -m minizero.run --stage 3 --world-size 4 --shard-group-size 2
    python -m pytest tests/test_hsdp.py

[Note: hierarchical sharding] The paper's ZeRO partitions over all N ranks. shard_group_size=S
partitions within groups of S consecutive ranks (`shard_group`, one row of mesh.mesh(S)) and
replicates across the N/S groups (`replicate_group`, the ranks that hold the same partition: one
column). Per rank, S replaces N in every sharded term of the memory formulas. The engine's families
partition over the shard group (the core engine's `group`: each bucket is cut into S partitions);
gradients are reduce-scattered within it (the average over its S ranks) and, at step(), this
rank's partition is all-reduced across the replicate group (the average over the N/S groups): the
average over all N. Parameters are all-gathered within the shard group. With S a node's size every
collective but that small all-reduce (2(N/S-1)/(N/S)·Ψ/S) stays inside the node. S = N (the
default, None) is the paper's ZeRO: both groups are None and nothing here runs. ZeRO++'s hpZ
(hpz.py) adds a third group, a node's R ranks, for stage 3's backward all-gather.

It plugs into the engine in assembled.py: the groups it makes (options.Sharding), the two
functions below.
"""

from __future__ import annotations

import torch
from torch import nn

from minizero import comm


def start_equal(model: nn.Module) -> None:
    """Every rank starts from rank 0's values: the engine broadcasts within its shard group only,
    so the groups are made equal first, over all N ranks (a model built partitioned has none)."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.untyped_storage().nbytes() >= t.numel() * t.element_size():
                comm.broadcast(t.data, src=0, tag="rank 0's initial values")


def average_across(grads: list[torch.Tensor], layout, replicate_group: comm.Group) -> None:
    """At step(): each bucket's partition, averaged in the shard group, averaged over the N/S
    groups too: the average over all N."""
    for b, g in zip(layout.buckets, grads):
        comm.all_reduce(g, op="avg", group=replicate_group, tag=f"bucket {b.index} across")
