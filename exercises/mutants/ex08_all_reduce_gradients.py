"""Mutant: all-reduces each unit's gradients and keeps its own partition: right numbers, twice a
reduce-scatter's bytes, and the whole averaged gradient materialized on every rank."""

import torch

from minizero import comm
from solutions.ex08_zero3_from_scratch import Zero3 as Right


class Zero3(Right):
    def finish(self, unit):
        staging = torch.zeros(unit.full.numel())
        offset = 0
        for p in unit.params:
            if p.grad is not None:
                staging[offset: offset + p.numel()] = p.grad.reshape(-1)
            offset += p.numel()
            p.grad = None
        handle = comm.all_reduce(staging, op="avg", async_op=True)
        mine = staging[comm.rank() * unit.size: (comm.rank() + 1) * unit.size]
        self.pending.append((unit, mine, handle))
        unit.ready.clear()
        unit.free()
