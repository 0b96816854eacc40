"""PyTorch's front ends: what torch.distributed users write, on minizero's collectives.

    from minizero.pytorch import fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy

fully_shard.py (FSDP2: per-parameter dim-0 shards; read it first, then fsdp_unit.py, fsdp_param.py,
fsdp_mesh.py and policies.py).
"""

from minizero.pytorch.fully_shard import (FSDPModule, UnshardHandle, fully_shard,
                                          register_fsdp_forward_method)
from minizero.pytorch.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
           "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]
