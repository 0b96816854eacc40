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
elements (1 MiB of fp32), each an nn.Parameter sharing the master's storage, with its own state.
Adam is elementwise, so nothing changes but speed: torch's CPU AdamW makes ~6 passes over each
parameter, and on a flat partition of 8 MB or more each pass streams master, gradient and moments
from DRAM; on 1 MiB views they stay in cache (2-3x faster: docs/performance.md). Invisible from
outside: master.grad is what is stepped (a step pre-hook hands each view its part), state_dict()
speaks in buckets.

[Note: parameter groups] torch's param_groups give parameters settings of their own, but a bucket
mixes groups (a block's weights and its LayerNorm), so each master is cut into *runs* where the
group changes (param_groups.py finds them), each run into views, and the torch optimizer gets one
param_group per user group, in order, holding that group's views. Padding is in no view it steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

# params -> optimizer; params a list of tensors, or (with parameter groups) of torch's group dicts
OptimizerFactory = Callable[[list], torch.optim.Optimizer]
# A run of a master's elements: (start, stop, index of its parameter group, or None: not stepped)
Run = tuple[int, int, "int | None"]

VIEW_NUMEL = 1 << 18    # elements of a master stepped at once [Note: cache-sized views]
# What the model can compute in (wrap's dtype=); the masters are fp32 either way.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Grouping:
    """The user's parameter groups as one rank's optimizer sees them [Note: parameter groups]."""
    settings: list[dict]       # each group's hyperparameters (no "params"), in the user's order
    runs: list[list[Run]]      # for each part: its elements cut where the group changes


class OptimizerHome(Protocol):
    """Where P_os lives, as the engine, checkpoints and the memory meter use it: the one interface
    of ShardOptimizer (below: the device), offload.HostShardOptimizer (host memory), the homes
    beyond/ adds and fairscale's FlatParameters (the user's optimizer steps those).
    tests/test_architecture.py checks each has every method, with these arguments."""
    param_parts: list[torch.Tensor]    # what it updates: views into the model's parameter storage

    def reload(self) -> None: ...      # the parameters were written from outside: masters follow
    def master_values(self) -> list[torch.Tensor]: ...   # fp32 values, one per part
    def device_tensors(self) -> list[torch.Tensor]: ...  # what it holds on the device (memory)
    def host_tensors(self) -> list[torch.Tensor]: ...    # ... in host memory
    def disk_bytes(self) -> int: ...                     # ... in a file


class SteppedHome(OptimizerHome, Protocol):
    """An OptimizerHome the engine steps (all but FSDP's, whose user steps): engine.step() hands it
    the averaged gradients; checkpoints save and load its state; `optimizer` is torch's."""
    optimizer: torch.optim.Optimizer

    def step(self, grad_parts: list[torch.Tensor]) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state_dict: dict) -> None: ...


def fp32_master(part: torch.Tensor) -> nn.Parameter:
    """The parameter the optimizer steps for `part` (one bucket's shard of the model's storage)."""
    if part.dtype == torch.float32:
        return nn.Parameter(part.detach())      # shares storage: the fp32 parameters are the master
    return nn.Parameter(part.detach().float().clone())             # fp32 master copy [part.numel()]


class ShardOptimizer:
    """Steps `param_parts` (views into the model's parameter storage, one 1-D tensor per bucket:
    all of it, or this rank's partition) with the user's optimizer, through one fp32 master per
    part, never the model's own parameters. `views[i]`: the views of masters[i], cut where
    grouping's runs change group. masters: where they live (offload.py), fp32_master's if None."""

    def __init__(self, param_parts: list[torch.Tensor], optimizer_factory: OptimizerFactory,
                 grouping: Grouping | None = None, masters: list[nn.Parameter] | None = None):
        self.param_parts = param_parts
        self.masters = masters if masters is not None else [fp32_master(p) for p in param_parts]
        runs = [[(0, m.numel(), 0)] for m in self.masters] if grouping is None else grouping.runs
        self.views: list[list[nn.Parameter]] = []      # no copy: they share the masters' storage
        self.view_groups: list[list[int | None]] = []  # each view's group (None: not stepped)
        for master, master_runs in zip(self.masters, runs):
            views, groups = [], []
            for start, stop, group in master_runs:
                pieces = master.detach()[start:stop].tensor_split(
                    max(1, round((stop - start) / VIEW_NUMEL)))
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

    def _state(self, view: nn.Parameter) -> dict:
        """The optimizer's state of a view; a throwaway dict for a view it does not step."""
        return self.optimizer.state[view] if id(view) in self._index else {}

    def _grads_to_views(self) -> None:
        """Each view's gradient is its slice of master.grad (None when the master has none)."""
        for master, views, sizes in zip(self.masters, self.views, self._sizes):
            grads = [None] * len(views) if master.grad is None else master.grad.split(sizes)
            for v, g in zip(views, grads):
                v.grad = g

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
        masters take their values."""
        with torch.no_grad():
            for master, part in zip(self.masters, self.param_parts):
                if master.data_ptr() != part.data_ptr():
                    master.copy_(part.reshape(-1))

    # --- for memory accounting and checkpoints ----------------------------------------------------
    def state_dict(self) -> dict:
        """torch's state_dict with one entry per bucket (what a checkpoint saves): a state with one
        value per element concatenated over a master's views (zeros where a view is not stepped),
        any other (Adam's step) the first stepped view's; "params" of a group: its buckets."""
        saved, state = self.optimizer.state_dict(), {}
        for b, views in enumerate(self.views):
            parts = [saved["state"].get(self._index.get(id(v)), {}) for v in views]
            first = next((j for j, s in enumerate(parts) if s), None)
            if first is None:
                continue
            state[b] = {
                name: torch.cat([s[name] if s else torch.zeros(v.shape, dtype=value.dtype)
                                 for s, v in zip(parts, views)])
                if _per_element(value, views[first])
                else value
                for name, value in parts[first].items()
            }
        bucket_of = {self._index[id(v)]: b for b, views in enumerate(self.views)
                     for v in views if id(v) in self._index}
        groups = [{**g, "params": sorted({bucket_of[i] for i in g["params"]})}
                  for g in saved["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """The inverse of state_dict(): each bucket's per-element state cut into its views; the
        groups' settings are the saved ones (which views each steps is this optimizer's own)."""
        current = self.optimizer.state_dict()["param_groups"]
        if len(state_dict["param_groups"]) != len(current):
            raise ValueError(f"the optimizer state has {len(state_dict['param_groups'])} "
                             f"parameter groups, this optimizer {len(current)}")
        state = {}
        for b, bucket_state in state_dict["state"].items():
            b = int(b)
            for j, view in enumerate(self.views[b]):
                if id(view) not in self._index:
                    continue                                   # not stepped: no state
                state[self._index[id(view)]] = {
                    name: value.split(self._sizes[b])[j].clone()
                    if _per_element(value, self.masters[b])
                    # each view counts its own step
                    else (value.clone() if torch.is_tensor(value) else value)
                    for name, value in bucket_state.items()
                }
        groups = [{**saved, "params": now["params"]}
                  for saved, now in zip(state_dict["param_groups"], current)]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    def state_tensors(self) -> list[torch.Tensor]:
        """Master copies and every tensor of optimizer state: the paper's KΨ/N (DDP: KΨ)."""
        tensors = list(self.masters)
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
        return tensors

    def device_tensors(self) -> list[torch.Tensor]:
        return self.state_tensors()

    def host_tensors(self) -> list[torch.Tensor]:
        return []

    def disk_bytes(self) -> int:
        return 0                      # it keeps its state in memory

    def master_values(self) -> list[torch.Tensor]:
        """The fp32 values of the owned parameters, one per part (for full_state_dict)."""
        return [m.detach() for m in self.masters]


def _per_element(value, like: torch.Tensor) -> bool:
    """A state with one value per element of `like` (Adam's moments, SGD's momentum)."""
    return torch.is_tensor(value) and value.shape == like.shape
