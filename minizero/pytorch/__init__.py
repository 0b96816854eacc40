"""PyTorch's front ends: what torch.distributed users write, on minizero's collectives.

    from minizero.pytorch import fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy

fully_shard.py (FSDP2: per-parameter dim-0 shards): read it first, then fsdp_unit.py (what happens
to a unit), fsdp_root.py (what the units share), fsdp_reduce.py (their gradients), fsdp_param.py
(one parameter's shard), fsdp_module.py (FSDPModule's methods), fsdp_mesh.py (the DeviceMesh's
groups) and policies.py.
"""

from minizero.pytorch.fsdp_module import FSDPModule, UnshardHandle, register_fsdp_forward_method
from minizero.pytorch.fully_shard import fully_shard
from minizero.pytorch.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
           "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]
