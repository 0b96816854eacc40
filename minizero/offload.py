"""CPU offload (ZeRO-Offload): the optimizer lives in host memory, the device keeps what computes.

    python -m minizero.run --stage 2 --world-size 4 --offload          # optimizer on the host
    python -m minizero.run --stage 3 --world-size 4 --offload params   # + parameter shards

Used by stages 1-3 (`minizero.wrap(..., offload=True)`). Per step, for this rank's partition (Ψ/N):

    device --(averaged gradient partition, 2Ψ/N bytes)--> host fp32 gradient buffer      [Ψ/N] fp32
    host:   optimizer step on the fp32 master weights and their state (the KΨ/N of the paper)
    host   --(updated parameter partition, 2Ψ/N bytes)--> device parameters, rounded to bf16

So the device drops the KΨ/N optimizer bytes (12Ψ/N for Adam) for two copies of Ψ/N and an O(Ψ/N)
CPU step. On CUDA the host buffers are pinned, the copies asynchronous; on a CPU-only run the code
path is the same. offload="params" (stage 3: the parameter shard too) is in zero3.py.
"""

from __future__ import annotations

import torch
from torch import nn

from minizero import comm
from minizero.optim import OptimizerFactory, Placement, ShardOptimizer, cache_sized


def optimizer_home(offload: bool | str):
    """Where P_os lives, by wrap's offload=: (parts, factory, grouping, placement) -> the optimizer.
    The device (optim.ShardOptimizer) or host memory (HostShardOptimizer, below; offload="params"
    too: stage 3 offloads its parameter shard and the optimizer with it)."""
    return HostShardOptimizer if offload else ShardOptimizer


class HostShardOptimizer(ShardOptimizer):
    """A ShardOptimizer whose fp32 masters, gradients and state are host tensors."""

    def __init__(self, param_parts: list[torch.Tensor], optimizer_factory: OptimizerFactory,
                 grouping=None, placement: Placement | None = None, *,
                 cut=cache_sized):
        self.pin = comm.device().type == "cuda"     # pinned memory makes device<->host copies async
        self.host_grads = [torch.zeros(p.numel(), dtype=torch.float32, pin_memory=self.pin)
                           for p in param_parts]     # [Ψ_b / N] fp32 each
        # always a separate host copy, also in fp32: the device parameters are not the master
        masters = [nn.Parameter(torch.empty(p.numel(), dtype=torch.float32, pin_memory=self.pin)
                                .copy_(p.detach().reshape(-1))) for p in param_parts]
        super().__init__(param_parts, optimizer_factory, grouping, placement, masters=masters,
                         cut=cut)

    def _grads_for_masters(self, grad_parts: list[torch.Tensor]) -> list[torch.Tensor]:
        for host, grad in zip(self.host_grads, grad_parts):
            host.copy_(grad, non_blocking=True)      # device -> host (upcasts bf16 to fp32)
        if self.pin:
            # the host step must not read half-copied gradients
            torch.cuda.current_stream().synchronize()
        return self.host_grads

    def device_tensors(self) -> list[torch.Tensor]:
        return []

    def host_tensors(self) -> list[torch.Tensor]:
        return self.state_tensors() + self.host_grads
