"""ZeRO++'s hpZ (hierarchical partitioning): stage 3's backward all-gather stays inside a node.

    engine = minizero.wrap(model, 3, optimizer, hpz_group_size=R)     # R ranks per node
    python -m pytest tests/test_hsdp.py -k hpz

[Note: hpZ] Stage 3 all-gathers every unit twice a step, in forward and in backward, over all N
ranks: across nodes both times. hpZ keeps, after the forward all-gather, each rank's 1/R of the
full unit (the *secondary* partition [Ψ_u / R], its slice within its node's group of R ranks:
beyond/mesh.py's row_group), so that backward's all-gather runs inside the node from those. Bytes
across nodes per step: 3Ψ -> 2Ψ; the price, Ψ/R more parameter memory between a unit's forward
and its backward (memory.secondary_partition_bytes). DeepSpeed's zero_hpz_partition_size.

It plugs into zero3.Unit as a mixin (HpzUnit, composed into units.ModelUnit): the forward gather
keeps the secondary, `route_for` sends backward's gather from it, post-backward drops it.
"""

from __future__ import annotations

import torch

from minizero import comm, events
from minizero.flat import partition
from minizero.zero3 import ShardState, TrainingState


class HpzUnit:
    """A zero3.Unit mixin: the unit's secondary partitions, kept while the engine has an hpz_group
    (wrap's hpz_group_size)."""
    secondary: list[torch.Tensor] | None = None     # one [Ψ_u / R] per buffer, between fwd and bwd

    def gather(self, prefetch: bool = False, forward: bool = False) -> None:
        was = self.state
        super().gather(prefetch, forward)
        if (self.owner.hpz_group is not None and was != ShardState.GATHERED
                and self.state == ShardState.GATHERED
                and self.training_state == TrainingState.FORWARD):
            self._keep_secondary()

    def route_for(self, forward: bool):
        if self.training_state == TrainingState.PRE_BACKWARD and self.secondary is not None:
            return FromSecondary(self)
        return super().route_for(forward)

    def post_backward(self, reduce_scatter):
        handle = super().post_backward(reduce_scatter)
        self.drop_secondary()                          # its backward all-gather is done
        return handle

    def end_backward(self) -> None:
        super().end_backward()
        self.drop_secondary()

    def _keep_secondary(self) -> None:
        """Keep this rank's 1/R of the full unit, its slice within the node's group."""
        group = self.owner.hpz_group
        self.drop_secondary()
        self.secondary = [partition(full, group.index, group.size).clone()
                          for full, _ in self.buffers()]
        events.emit("secondary", engine=self.owner, unit=self,
                    nbytes=sum(t.nbytes for t in self.secondary))

    def drop_secondary(self) -> None:
        if self.secondary is not None:
            events.emit("secondary", engine=self.owner, unit=self,
                        nbytes=-sum(t.nbytes for t in self.secondary))
        self.secondary = None


class FromSecondary:
    """The route of a unit's backward all-gather under hpZ: within its node's group, from the
    secondary partitions (whatever shard it is handed)."""

    def __init__(self, unit: HpzUnit):
        self.group = unit.owner.hpz_group
        self.source = {id(full): part for (full, _), part in zip(unit.buffers(), unit.secondary)}

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                   group=None, tag: str = ""):
        return comm.all_gather(output, self.source[id(output)], async_op=async_op,
                               group=self.group, tag=tag)


def secondaries(units) -> list[torch.Tensor]:
    """The secondary partitions alive now (engine.memory() counts them as parameters)."""
    return [t for unit in units for t in (getattr(unit, "secondary", None) or [])]
