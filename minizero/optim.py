"""Master weights and optimizer state for the parameters one rank owns: the P_os of ZeRO.

Every stage steps its parameters through a `ShardOptimizer`. What differs between stages is only
*how much* it is given: DDP hands it all Ψ parameters (every rank steps everything, identically),
stages 1-3 hand it this rank's partition, Ψ/N of them. That single difference is the
optimizer-state saving:
K bytes per parameter become K/N.

Mixed precision (the paper's accounting, K = 12 for Adam):
    the model computes in bf16 or fp16 (2 bytes a parameter, 2 a gradient); the optimizer keeps a
    fp32 *master* copy of its parameters (4) plus Adam's two moments (4 + 4). Each step: fp32
    master <- update with the gradient upcast to fp32, then the bf16/fp16 parameters <- master,
    rounded. (fp16 gradients arrive unscaled, already fp32: engine.step, loss_scale.py.)
fp32 training has no master copy: the optimizer steps the fp32 parameter buffer itself (K = 8).

`minizero.offload.HostShardOptimizer` is the same object with the master and the state in
host memory.

[Note: cache-sized views] The optimizer does not step one master per bucket, but equal *views* of it
of about VIEW_NUMEL elements (1 MiB of fp32; a master up to 1.5x that is one view), each its own
nn.Parameter sharing the master's storage, with its own optimizer state. Nothing is copied and no
value changes (Adam is elementwise: a view is stepped exactly as its elements would be inside the
whole). Why: torch's CPU AdamW (the single-tensor path) makes ~6 passes over each parameter
(moments, denominator, update). On a flat partition of 8 MB or more each pass streams the master,
the gradient and both moments from DRAM; on 1 MiB views the 4-5 tensors of one view stay in cache
from one pass to the next (2-3x faster: docs/performance.md). DeepSpeed steps one flat partition per
group and pays the same price. The views are
invisible from outside: master.grad is what the optimizer steps (a step pre-hook hands each view its
part), state_dict() speaks in buckets, and the state's bytes are the same KΨ/N (plus Adam's 4-byte
step counter per view).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

# About how many elements of a master the optimizer steps at once [Note: cache-sized views]: 1 MiB
# of fp32.
VIEW_NUMEL = 1 << 18

# The precisions the model can compute in (wrap's dtype=...). The masters are fp32 either way.
# fp16 also needs loss scaling (loss_scale.py): its 5 exponent bits lose small gradients.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ShardOptimizer:
    """Steps `param_parts` (views into the model's parameter storage) with the user's optimizer.

    param_parts: one 1-D tensor per bucket, e.g. this rank's partition of each bucket's flat
    parameters. The optimizer steps one nn.Parameter per part (the master), never the model's own
    parameters: set master.grad and call self.optimizer.step(). It sees each master as equal views
    of about VIEW_NUMEL elements (`views[i]`: the views of masters[i]) [Note: cache-sized views].
    """

    def __init__(self, param_parts: list[torch.Tensor], optimizer_factory: OptimizerFactory):
        self.param_parts = param_parts
        self.masters = [self._make_master(p) for p in param_parts]
        self.views = [
            [
                nn.Parameter(v)
                for v in m.detach().tensor_split(max(1, round(m.numel() / VIEW_NUMEL)))
            ]
            for m in self.masters
        ]  # no copy: they share the masters' storage
        # optimizer index
        self._first_view = [sum(map(len, self.views[:b])) for b in range(len(self.views))]
        self.optimizer = optimizer_factory([v for views in self.views for v in views])
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory must return a torch.optim.Optimizer, got "
                            f"{type(self.optimizer).__name__}")
        self.optimizer.register_step_pre_hook(lambda *_: self._grads_to_views())

    def _grads_to_views(self) -> None:
        """Each view's gradient is its slice of master.grad (None when the master has none)."""
        for master, views in zip(self.masters, self.views):
            grads = (
                [None] * len(views) if master.grad is None else master.grad.tensor_split(len(views))
            )
            for v, g in zip(views, grads):
                v.grad = g

    def _make_master(self, part: torch.Tensor) -> nn.Parameter:
        if part.dtype == torch.float32:
            return nn.Parameter(part.detach())  # shares storage: the fp32 parameters are the master
        return nn.Parameter(part.detach().float().clone())         # fp32 master copy [part.numel()]

    def step(self, grad_parts: list[torch.Tensor]) -> None:
        """One optimizer step on the owned parameters, given their averaged gradients."""
        for master, grad in zip(self.masters, self._grads_for_masters(grad_parts)):
            master.grad = grad
        self.optimizer.step()
        for master, part in zip(self.masters, self.param_parts):
            master.grad = None
            if master.data_ptr() != part.data_ptr():
                # fp32 master -> bf16 params (rounds)
                part.copy_(master.detach(), non_blocking=True)
        self._grads_to_views()                                    # and the views' gradients: None

    def _grads_for_masters(self, grad_parts: list[torch.Tensor]) -> list[torch.Tensor]:
        # The optimizer needs gradients of its parameters' dtype: upcast bf16 gradients (a
        # transient copy).
        return [g if g.dtype == m.dtype else g.float() for g, m in zip(grad_parts, self.masters)]

    def reload(self) -> None:
        """The parameters were written from outside (engine.gathered(modifier_rank=...)): the
        masters take their values, so the next step starts from what was written (rounded, if the
        model is bf16)."""
        with torch.no_grad():
            for master, part in zip(self.masters, self.param_parts):
                if master.data_ptr() != part.data_ptr():
                    master.copy_(part.reshape(-1))

    # --- for memory accounting and checkpoints ----------------------------------------------------
    def state_dict(self) -> dict:
        """The torch optimizer's state_dict with one entry per bucket (the views joined back): what
        a checkpoint saves. A state with one value per element is concatenated over a master's
        views; any other (Adam's step, the same for every view) is the first view's."""
        saved, state = self.optimizer.state_dict(), {}
        for b, (first, views) in enumerate(zip(self._first_view, self.views)):
            parts = [saved["state"].get(first + j, {}) for j in range(len(views))]
            if parts[0]:
                state[b] = {
                    name: torch.cat([s[name] for s in parts])
                    if _per_element(value, views[0])
                    else value
                    for name, value in parts[0].items()
                }
        groups = [
            {**g, "params": [b for b, first in enumerate(self._first_view) if first in g["params"]]}
            for g in saved["param_groups"]
        ]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """The inverse of state_dict(): cut each bucket's per-element state into its views."""
        state = {}
        for b, bucket_state in state_dict["state"].items():
            b = int(b)
            for j in range(len(self.views[b])):
                state[self._first_view[b] + j] = {
                    name: value.tensor_split(len(self.views[b]))[j].clone()
                    if _per_element(value, self.masters[b])
                    # each view counts its own step
                    else (value.clone() if torch.is_tensor(value) else value)
                    for name, value in bucket_state.items()
                }
        groups = [
            {
                **g,
                "params": [
                    self._first_view[b] + j for b in g["params"] for j in range(len(self.views[b]))
                ],
            }
            for g in state_dict["param_groups"]
        ]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    def state_tensors(self) -> list[torch.Tensor]:
        """Master copies (when separate) and every tensor of optimizer state: the KΨ(/N) of
        the paper."""
        tensors = list(self.masters)
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
        return tensors

    def device_tensors(self) -> list[torch.Tensor]:
        return self.state_tensors()

    def host_tensors(self) -> list[torch.Tensor]:
        return []

    def disk_bytes(self) -> int:
        return 0                      # the disk tier (disk.py) keeps its state in a file

    def master_values(self) -> list[torch.Tensor]:
        """The fp32 values of the owned parameters, one per part, wherever they live
        (for full_state_dict)."""
        return [m.detach() for m in self.masters]


def _per_element(value, like: torch.Tensor) -> bool:
    """A state with one value per element of `like` (Adam's moments, SGD's momentum)."""
    return torch.is_tensor(value) and value.shape == like.shape
