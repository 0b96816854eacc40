"""The ZeRO paper's Figure 1 as the code's table: each stage is one row of three families.

    python -m minizero.run --stage 2 --world-size 4       # any row
    engine = minizero.wrap(model, 2, functools.partial(torch.optim.AdamW, lr=1e-3))

The paper partitions three model states over the N ranks, one more at each stage: the optimizer
states (P_os), the gradients (P_g), the parameters (P_p). Each is a family of small classes; a stage
picks one of each (the table below), engine.py builds the engine from its row. Read a row, then
the one class it adds, in its stage's file:

  parameters (P_p)   ddp.ReplicatedParameters: whole on each rank, all-gathered after a step (1-2)
                     zero3.ShardedUnits: partitioned, gathered one unit at a time (Unit)
  gradients  (P_g)   ddp.AllReducedGradients: averaged everywhere, bucket by bucket in backward
                     zero1.GradientsReducedAtStep: accumulated whole, reduce-scattered at the step
                     zero2.GradientShard: reduce-scattered bucket by bucket in backward; Ψ/N kept
  optimizer  (P_os)  handed Ψ/N (partitioned) or Ψ; it lives on the device or, with offload=,
                     the host (offload.optimizer_home)
  buckets            how the flat layout cuts the parameters into buckets (flat.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from minizero.ddp import AllReducedGradients, ReplicatedParameters
from minizero.engine import Engine
from minizero.flat import by_size, whole_model
from minizero.zero1 import GradientsReducedAtStep
from minizero.zero2 import GradientShard
from minizero.zero3 import ShardedUnits


@dataclass(frozen=True)
class Stage:
    number: int
    parameters: type                   # P_p's family
    gradients: type                    # P_g's family
    partitioned: bool                  # P_os: the optimizer steps this rank's partition
    buckets: Callable | None           # (trainable, bucket_size) -> buckets; None: stage 3's units
    optimizer: Callable | None = None  # (parts, factory, grouping, placement) -> home, or offload


TABLE = {
    #         P_p: parameters       P_g: gradients          P_os   buckets
    0: Stage(0, ReplicatedParameters, AllReducedGradients,    False, by_size),
    1: Stage(1, ReplicatedParameters, GradientsReducedAtStep, True,  whole_model),
    2: Stage(2, ReplicatedParameters, GradientShard,          True,  by_size),
    3: Stage(3, ShardedUnits,         GradientShard,          True,  None),    # a bucket per unit
}


class DDP(Engine):
    row = TABLE[0]


class Zero1(Engine):
    row = TABLE[1]


class Zero2(Engine):
    row = TABLE[2]


class Zero3(Engine):
    row = TABLE[3]            # its units: engine.params.units (zero3.ShardedUnits), forward order


ENGINES = {0: DDP, 1: Zero1, 2: Zero2, 3: Zero3}
