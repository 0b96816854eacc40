"""Master weights and optimizer state for the parameters one rank owns: the P_os of ZeRO.

Every stage steps its parameters through a `ShardOptimizer`. What differs between stages is only *how
much* it is given: DDP hands it all Ψ parameters (every rank steps everything, identically), stages 1-3
hand it this rank's partition, Ψ/N of them. That single difference is the optimizer-state saving:
K bytes per parameter become K/N.

Mixed precision (the paper's accounting, K = 12 for Adam):
    the model computes in bf16 or fp16 (2 bytes a parameter, 2 a gradient); the optimizer keeps a fp32
    *master* copy of its parameters (4) plus Adam's two moments (4 + 4). Each step: fp32 master <- update
    with the gradient upcast to fp32, then the bf16/fp16 parameters <- master, rounded. (fp16 gradients
    arrive unscaled, already fp32: engine.step, loss_scale.py.)
fp32 training has no master copy: the optimizer steps the fp32 parameter buffer itself (K = 8).

`minizero.offload.HostShardOptimizer` is the same object with the master and the state in host memory.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

# The precisions the model can compute in (wrap's dtype=...). The masters are fp32 either way.
# fp16 also needs loss scaling (loss_scale.py): its 5 exponent bits lose small gradients.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ShardOptimizer:
    """Steps `param_parts` (views into the model's parameter storage) with the user's optimizer.

    param_parts: one 1-D tensor per bucket, e.g. this rank's partition of each bucket's flat parameters.
    The optimizer sees one nn.Parameter per part (the master), never the model's own parameters.
    """

    def __init__(self, param_parts: list[torch.Tensor], optimizer_factory: OptimizerFactory):
        self.param_parts = param_parts
        self.masters = [self._make_master(p) for p in param_parts]
        self.optimizer = optimizer_factory(self.masters)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory must return a torch.optim.Optimizer, got "
                            f"{type(self.optimizer).__name__}")

    def _make_master(self, part: torch.Tensor) -> nn.Parameter:
        if part.dtype == torch.float32:
            return nn.Parameter(part.detach())         # shares storage: the fp32 parameters are the master
        return nn.Parameter(part.detach().float().clone())          # fp32 master copy [part.numel()]

    def step(self, grad_parts: list[torch.Tensor]) -> None:
        """One optimizer step on the owned parameters, given their averaged gradients."""
        for master, grad in zip(self.masters, self._grads_for_masters(grad_parts)):
            master.grad = grad
        self.optimizer.step()
        for master, part in zip(self.masters, self.param_parts):
            master.grad = None
            if master.data_ptr() != part.data_ptr():
                part.copy_(master.detach(), non_blocking=True)    # fp32 master -> bf16 params (rounds)

    def _grads_for_masters(self, grad_parts: list[torch.Tensor]) -> list[torch.Tensor]:
        # The optimizer needs gradients of its parameters' dtype: upcast bf16 gradients (a transient copy).
        return [g if g.dtype == m.dtype else g.float() for g, m in zip(grad_parts, self.masters)]

    def reload(self) -> None:
        """The parameters were written from outside (engine.gathered(modifier_rank=...)): the masters take
        their values, so the next step starts from what was written (rounded, if the model is bf16)."""
        with torch.no_grad():
            for master, part in zip(self.masters, self.param_parts):
                if master.data_ptr() != part.data_ptr():
                    master.copy_(part.reshape(-1))

    # --- for memory accounting and checkpoints --------------------------------------------------------
    def state_tensors(self) -> list[torch.Tensor]:
        """Master copies (when separate) and every tensor of optimizer state: the KΨ(/N) of the paper."""
        tensors = list(self.masters)
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
        return tensors

    def device_tensors(self) -> list[torch.Tensor]:
        return self.state_tensors()

    def host_tensors(self) -> list[torch.Tensor]:
        return []

    def master_values(self) -> list[torch.Tensor]:
        """The fp32 values of the owned parameters, one per part, wherever they live (for full_state_dict)."""
        return [m.detach() for m in self.masters]
