"""Where a `fully_shard` unit's collectives run: its DeviceMesh, as minizero.comm groups.

    mesh = init_device_mesh("cpu", (4,))                       # FSDP: shard over 4 ranks
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))     # HSDP

FSDP2 takes a torch DeviceMesh: 1-D, every parameter sharded over its ranks (placements
(Shard(0),)); 2-D, HSDP: sharded over the ranks of dim 1 and replicated over dim 0's ((Replicate(),
Shard(0))), so a unit's gradients are reduce-scattered within its row of the mesh and all-reduced
down its column, as minizero's shard_group_size does for the flat layout ([Note: hierarchical
sharding] in beyond/hierarchical.py). The DTensors keep the mesh; the collectives run through
minizero.comm, on the mesh's own process groups (process_groups.group_of), so they are tallied and
on the event stream like every other stage's. reshard_after_forward=k adds a third group: k
consecutive ranks of the shard group, which keep 1/k of a unit between forward and backward and
all-gather it among themselves in backward (ZeRO++'s hpZ secondary partition is the same idea:
[Note: hpZ] in beyond/hpz.py).
"""

from __future__ import annotations

import warnings

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from minizero import comm
from minizero.pytorch.process_groups import group_of


_post_forward_groups: dict[tuple, comm.Group] = {}    # (world, ranks) -> group, made once


class MeshGroups:
    """A unit's groups: shard (its all-gathers and reduce-scatters), replicate (HSDP's all-reduce;
    None for a 1-D mesh) and post_forward (reshard_after_forward=k: k ranks; None otherwise).
    `after_forward` is True, False or k, as FSDP2 reads the argument."""

    def __init__(self, mesh: DeviceMesh | None, reshard_after_forward):
        if not dist.is_initialized():
            raise ValueError("fully_shard needs a process group: run under minizero.launch or "
                             "torchrun (or torch.distributed.init_process_group first)")
        device = comm.device().type
        self.mesh = init_device_mesh(device, (comm.world_size(),)) if mesh is None else mesh
        if not isinstance(self.mesh, DeviceMesh):
            raise TypeError(f"fully_shard: mesh must be a torch DeviceMesh, got "
                            f"{type(mesh).__name__}")
        if self.mesh.ndim not in (1, 2):
            raise ValueError(f"fully_shard: mesh must be 1-D (FSDP) or 2-D (HSDP: replicate, "
                             f"shard), got {self.mesh.ndim}-D")
        if self.mesh.device_type != device:
            raise ValueError(f"fully_shard: mesh is on {self.mesh.device_type!r} but this rank "
                             f"computes on {device!r}")
        hsdp = self.mesh.ndim == 2
        self.placements = (Replicate(), Shard(0)) if hsdp else (Shard(0),)
        self.shard = group_of(self.mesh.get_group(1 if hsdp else 0))
        self.replicate = group_of(self.mesh.get_group(0)) if hsdp else None
        self.after_forward = _after_forward(reshard_after_forward, comm.group_size(self.shard))
        self.post_forward = (self._post_forward_group(self.after_forward)
                             if type(self.after_forward) is int else None)

    @property
    def shard_size(self) -> int:
        return comm.group_size(self.shard)

    @property
    def shard_rank(self) -> int:
        return comm.group_rank(self.shard)

    @property
    def data_parallel_size(self) -> int:
        """The ranks a gradient is averaged over: the shard group's, times the replicas."""
        return self.shard_size * comm.group_size(self.replicate) if self.replicate else \
            self.shard_size

    def _post_forward_group(self, k: int) -> comm.Group:
        """This rank's group of k consecutive ranks in the mesh. Every rank makes every such group
        (dist.new_group is collective), so the mesh must hold every rank."""
        grid = self.mesh.mesh
        if grid.numel() != comm.world_size():
            raise ValueError(f"fully_shard: reshard_after_forward={k} needs a mesh over every "
                             f"rank (this one has {grid.numel()} of {comm.world_size()})")
        mine = None
        for row in grid.reshape(-1, k).tolist():
            key = (id(dist.group.WORLD), tuple(row))
            if key not in _post_forward_groups:
                _post_forward_groups[key] = comm.Group(row)
            if comm.rank() in row:
                mine = _post_forward_groups[key]
        return mine


def _after_forward(value, shard_size: int):
    """reshard_after_forward as FSDP2 reads it: None (the root's is decided at its first
    forward), True, False, or k ranks (1 < k < shard size: 1 means False, the shard size True)."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(f"fully_shard: reshard_after_forward must be a bool or an int, got "
                        f"{type(value).__name__}")
    if not 1 <= value <= shard_size or shard_size % value:
        raise ValueError(f"fully_shard: reshard_after_forward={value} must divide the shard "
                         f"group's {shard_size} ranks")
    if value == 1:
        warnings.warn("fully_shard: reshard_after_forward=1 keeps the whole unit after forward "
                      "(as False); True frees it", stacklevel=4)
        return False
    return True if value == shard_size else value
