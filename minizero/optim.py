"""Master weights and optimizer state for the parameters one rank owns: the P_os of ZeRO.

Every stage steps its parameters through a `ShardOptimizer`; stages differ only in *how much* it is
given: DDP hands it all Ψ parameters (every rank steps everything, identically), stages 1-3 this
rank's partition, Ψ/N of them. That single difference is the saving: K bytes per parameter -> K/N.

Mixed precision (the paper's accounting, K = 12 for Adam): the model computes in bf16 or fp16 (2
bytes a parameter, 2 a gradient); the optimizer keeps an fp32 *master* copy (4) plus Adam's two
moments (4 + 4). Each step updates the master with the gradient upcast to fp32, then rounds it into
the 16-bit parameters. fp32 training has no copy: the fp32 parameters are the master (K = 8).
offload.HostShardOptimizer is the same with the master and the state in host memory.

[Note: cache-sized views] The optimizer steps each master as equal *views* of about VIEW_NUMEL
elements (1 MiB of fp32), nn.Parameters sharing its storage. Adam is elementwise, so only speed
changes: torch's CPU AdamW makes ~6 passes over a parameter, which stay in cache for 1 MiB but
stream from DRAM for a flat partition (2-3x slower: docs/performance.md). Outside, master.grad is
what is stepped (a step pre-hook hands each view its part); homes.py's state_dict() is by bucket.

[Note: parameter groups] torch's param_groups give parameters settings of their own, but a bucket
mixes groups (a block's weights and its LayerNorm), so each master is cut into *runs* where the
group changes (param_groups.py finds them), each run into views, and the torch optimizer gets one
param_group per user group, in order, holding that group's views. Padding is in no view it steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

OptimizerFactory = Callable[[list], torch.optim.Optimizer]   # tensors, or torch's group dicts
VIEW_NUMEL = 1 << 18    # elements of a master stepped at once [Note: cache-sized views]
# What the model can compute in (wrap's dtype=); the masters are fp32 either way.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Placement:
    """Where a home's parts sit: part i is elements [starts[i], starts[i] + part.numel()) of
    buckets[i]. Elementwise homes need not know; Muon's (whole matrices) does."""
    buckets: list          # flat.Bucket, one per part
    starts: list[int]
    group: object          # the comm.Group the engine partitions over (None: all N)


def fp32_master(part: torch.Tensor) -> nn.Parameter:
    """The parameter the optimizer steps for `part` (one bucket's shard of the model's storage)."""
    if part.dtype == torch.float32:
        return nn.Parameter(part.detach())      # shares storage: the fp32 parameters are the master
    return nn.Parameter(part.detach().float().clone())             # fp32 master copy [part.numel()]


def cache_sized(part: int, start: int, stop: int, group: int | None) -> int:
    """Into how many views [Note: cache-sized views] elements [start, stop) of part `part` (a
    group's run) are cut; a home may cut elsewhere (a count or split points: torch.tensor_split)."""
    return max(1, round((stop - start) / VIEW_NUMEL))


class ShardOptimizer:
    """Steps `param_parts` (views into the model's parameter storage, one 1-D tensor per bucket:
    all of it, or this rank's partition) with the user's optimizer, through one fp32 master per
    part. `views[i]`: the views of masters[i], cut where grouping's runs change group, each run as
    `cut` says. masters: where they live (offload.py), fp32_master's if None."""

    def __init__(self, param_parts: list[torch.Tensor], optimizer_factory: OptimizerFactory,
                 grouping=None, placement: Placement | None = None, *,
                 masters: list[nn.Parameter] | None = None, cut=cache_sized):
        self.param_parts = param_parts
        self.masters = masters if masters is not None else [fp32_master(p) for p in param_parts]
        runs = [[(0, m.numel(), 0)] for m in self.masters] if grouping is None else grouping.runs
        self.views: list[list[nn.Parameter]] = []      # no copy: they share the masters' storage
        self.view_groups: list[list[int | None]] = []  # each view's group (None: not stepped)
        for i, (master, master_runs) in enumerate(zip(self.masters, runs)):
            views, groups = [], []
            for start, stop, group in master_runs:
                pieces = master.detach()[start:stop].tensor_split(cut(i, start, stop, group))
                views += [nn.Parameter(v) for v in pieces]
                groups += [group] * len(pieces)
            self.views.append(views)
            self.view_groups.append(groups)
        self._sizes = [[v.numel() for v in views] for views in self.views]
        if grouping is None:
            self.optimizer = optimizer_factory([v for views in self.views for v in views])
        else:
            self.optimizer = optimizer_factory([
                {**settings, "params": [v for views, groups in zip(self.views, self.view_groups)
                                        for v, g in zip(views, groups) if g == i]}
                for i, settings in enumerate(grouping.settings)])
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory must return a torch.optim.Optimizer, got "
                            f"{type(self.optimizer).__name__}")
        # each stepped view's index in the torch optimizer's state_dict (its groups' order)
        stepped = [p for group in self.optimizer.param_groups for p in group["params"]]
        self._index = {id(p): i for i, p in enumerate(stepped)}
        self.optimizer.register_step_pre_hook(lambda *_: self._grads_to_views())

    def _state(self, view: nn.Parameter) -> dict:       # (empty for a view it does not step)
        return self.optimizer.state[view] if id(view) in self._index else {}

    def _grads_to_views(self) -> None:
        """Each view's gradient: its slice of master.grad (None when the master has none)."""
        for master, views, sizes in zip(self.masters, self.views, self._sizes):
            grads = [None] * len(views) if master.grad is None else master.grad.split(sizes)
            for v, g in zip(views, grads):
                v.grad = g

    def step(self, grad_parts: list[torch.Tensor]) -> None:       # given the averaged gradients
        for master, grad in zip(self.masters, self._grads_for_masters(grad_parts)):
            master.grad = grad
        self.optimizer.step()
        for master, part in zip(self.masters, self.param_parts):
            master.grad = None
            if master.data_ptr() != part.data_ptr():
                part.copy_(master.detach(), non_blocking=True)    # fp32 master -> bf16 (rounds)
        self._grads_to_views()                                    # and the views' gradients: None

    def _grads_for_masters(self, grad_parts: list[torch.Tensor]) -> list[torch.Tensor]:
        # the optimizer needs gradients of its parameters' dtype: bf16 ones upcast (a copy)
        return [g if g.dtype == m.dtype else g.float() for g, m in zip(grad_parts, self.masters)]

    def state_tensors(self) -> list[torch.Tensor]:     # masters and state: KΨ/N (DDP: KΨ)
        tensors = list(self.masters)
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
        return tensors

    def device_tensors(self) -> list[torch.Tensor]:
        return self.state_tensors()

    def host_tensors(self) -> list[torch.Tensor]:
        return []
