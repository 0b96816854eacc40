"""The process group a PyTorch user hands a front end, as the minizero.comm group its collectives
take.

    group = group_of(process_group)    # None (every rank), dist.group.WORLD, dist.new_group(...),
                                       # or a 1-D DeviceMesh: a comm.Group, or None for the world

comm.Group makes its own process group (dist.new_group, collective over every rank). A user's
group exists already, and under torch's rules only its members need be there when it is used
(torch's non-default-group test leaves the others idle), so it is wrapped as it is (ProcessGroup).
Used by DistributedDataParallel, ZeroRedundancyOptimizer and fully_shard's DeviceMesh
(fsdp_mesh.py).
"""

from __future__ import annotations

import torch.distributed as dist

from minizero import comm


class ProcessGroup(comm.Group):
    """A comm.Group over a process group made already (comm.Group makes a new one)."""

    def __init__(self, process_group):          # not comm.Group's: no dist.new_group to call
        self.ranks = tuple(dist.get_process_group_ranks(process_group))
        self.size = len(self.ranks)
        self.index = self.ranks.index(comm.rank()) if comm.rank() in self.ranks else -1
        self.process_group = process_group


def group_of(process_group) -> comm.Group | None:
    """None for every rank (None, dist.group.WORLD, any group of all ranks in order); a comm.Group
    as it is; a torch ProcessGroup or a 1-D DeviceMesh as a ProcessGroup around it."""
    if process_group is None or isinstance(process_group, comm.Group):
        return process_group
    if hasattr(process_group, "get_group"):             # a DeviceMesh (2-D: raises, naming it)
        process_group = process_group.get_group()
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch ProcessGroup or a DeviceMesh, got "
                        f"{type(process_group).__name__}")
    group = ProcessGroup(process_group)
    return None if group.ranks == tuple(range(comm.world_size())) else group
