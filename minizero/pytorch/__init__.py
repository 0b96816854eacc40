"""PyTorch's front ends: what torch.distributed users write, on minizero's collectives.

    from minizero.pytorch import DistributedDataParallel, ZeroRedundancyOptimizer
    from minizero.pytorch import fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy

DistributedDataParallel is stage 0's buckets with your optimizer and your loss.backward()
(pytorch/ddp.py, its keywords in pytorch/ddp_options.py); ZeroRedundancyOptimizer gives each rank
whole parameters, next to zero1.py's flat partition (pytorch/zero_redundancy.py); both take a
process group as torch's do (process_groups.py). fully_shard.py (FSDP2: per-parameter dim-0
shards): read it first, then fsdp_unit.py (what happens to a unit), fsdp_root.py (what the units
share), fsdp_reduce.py (their gradients), fsdp_param.py (one parameter's shard), fsdp_module.py
(FSDPModule's methods), fsdp_mesh.py (the DeviceMesh's groups) and policies.py. docs/pytorch.md
says where each differs from PyTorch's.
"""

import importlib

from minizero.pytorch.ddp import DistributedDataParallel
from minizero.pytorch.zero_redundancy import ZeroRedundancyOptimizer

# FSDP2's names, imported on first use: they import torch's DTensor (~1 s a process here), which
# DistributedDataParallel and ZeroRedundancyOptimizer do not need. name -> its module
_FULLY_SHARD = {"FSDPModule": "fsdp_module", "UnshardHandle": "fsdp_module",
                "register_fsdp_forward_method": "fsdp_module", "fully_shard": "fully_shard",
                "CPUOffloadPolicy": "policies", "MixedPrecisionPolicy": "policies",
                "OffloadPolicy": "policies"}

__all__ = ["DistributedDataParallel", "ZeroRedundancyOptimizer", *sorted(_FULLY_SHARD)]


def __getattr__(name: str):
    if name not in _FULLY_SHARD:
        raise AttributeError(f"module 'minizero.pytorch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"minizero.pytorch.{_FULLY_SHARD[name]}"), name)
    globals()[name] = value          # importing fully_shard.py bound the name to the module
    return value
