"""PyTorch's front ends: DistributedDataParallel and ZeroRedundancyOptimizer as PyTorch users write
them, on minizero's core.

    from minizero.pytorch import DistributedDataParallel, ZeroRedundancyOptimizer
    python -m pytest tests/test_pytorch_ddp.py tests/test_zero_redundancy.py

Read ddp.py first (stage 0 with your optimizer and your loss.backward()), then zero_redundancy.py
(whole parameters per rank: torch's way of sharding optimizer state, next to zero1.py's flat
partition). docs/pytorch.md says where each one differs from torch's, and what it measures.
"""

from minizero.pytorch.ddp import DistributedDataParallel
from minizero.pytorch.zero_redundancy import ZeroRedundancyOptimizer

__all__ = ["DistributedDataParallel", "ZeroRedundancyOptimizer"]
