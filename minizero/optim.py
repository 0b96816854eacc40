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

[Note: parameter groups] torch's param_groups (Hugging Face's "no weight decay on biases and
norms", a lower lr for the embeddings) give parameters their own lr, weight_decay, betas, eps, any
key. DeepSpeed keeps one flat fp32 buffer per group, partitioned over the ranks. minizero keeps its
flat layout as it is (a bucket, a stage-3 unit, mixes groups: a block's weights and its LayerNorm),
and the groups live where the hyperparameters are used, here: each master is cut into *runs* where
the group changes (group_runs: from the bucket's parameter offsets and this rank's range of it),
each run into cache-sized views, and the torch optimizer gets one param_group per user group, in the
user's order, holding the views of that group (on every rank, empty where this rank owns none of
it): so a scheduler and get_lr see one entry per user group, with the user's settings. Adam is
elementwise, so a view stepped with its group's settings is exactly its parameters stepped by one
process with theirs. Padding and trainable parameters that are in no group are in no view the
optimizer steps: as in DeepSpeed, which builds its optimizer over the groups only, they are not
trained (their gradients are still reduced; the engine says so in one warning line). Without groups
(param_groups=None) every element is in the one group and the factory gets a plain list: views,
state and results exactly as before.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from minizero import comm

# params -> optimizer; params a list of tensors, or (with parameter groups) of torch's group dicts
OptimizerFactory = Callable[[list], torch.optim.Optimizer]
# A run of a master's elements: (start, stop, index of its parameter group, or None: not stepped)
Run = tuple[int, int, "int | None"]

# About how many elements of a master the optimizer steps at once [Note: cache-sized views]: 1 MiB
# of fp32.
VIEW_NUMEL = 1 << 18

# The precisions the model can compute in (wrap's dtype=...). The masters are fp32 either way.
# fp16 also needs loss scaling (loss_scale.py): its 5 exponent bits lose small gradients.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Grouping:
    """The user's parameter groups as one rank's optimizer sees them [Note: parameter groups]."""
    settings: list[dict]       # each group's hyperparameters (no "params"), in the user's order
    runs: list[list[Run]]      # for each part: its elements cut where the group changes
    group_of: dict[int, int]   # {id(parameter): its group}, every rank's parameters


@dataclass(frozen=True)
class Placement:
    """Where the parts an optimizer home is handed sit: part i is elements [starts[i], starts[i] +
    part.numel()) of buckets[i] (a flat.Bucket), the ranks of `group` (None: all N) hold the rest.
    The element-wise homes below do not need it; a home that needs whole parameters does
    (beyond/muon/: Muon orthogonalizes whole matrices)."""
    buckets: list          # flat.Bucket, one per part
    starts: list[int]
    group: comm.Group | None


def parse_param_groups(param_groups, named: list[tuple[str, nn.Parameter]]):
    """torch-style groups [{"params": [...], "lr": ...}, ...] over the model's parameters `named`
    -> (settings per group, {id(param): group index}). Frozen parameters in a group are never
    stepped (nothing to do); trainable ones in no group are not trained: one warning line (rank 0).
    Bad groups: one-line TypeError / ValueError."""
    if isinstance(param_groups, dict) or not isinstance(param_groups, (list, tuple)):
        raise TypeError("param_groups must be a list of dicts {'params': [...], 'lr': ...}, got "
                        f"{type(param_groups).__name__}")
    if not param_groups:
        raise ValueError("param_groups is empty: give at least one group, or None for one group "
                         "of every trainable parameter")
    name_of = {id(p): name for name, p in named}
    settings, group_of = [], {}
    for i, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"param_groups[{i}] must be a dict with 'params', got "
                            f"{type(group).__name__}")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if id(p) not in name_of:
                raise ValueError(f"param_groups[{i}] holds a tensor that is not a parameter of "
                                 "the model")
            if id(p) in group_of:
                raise ValueError(f"{name_of[id(p)]} is in parameter groups {group_of[id(p)]} and "
                                 f"{i}: a parameter belongs to one group")
            group_of[id(p)] = i
        settings.append({k: v for k, v in group.items() if k != "params"})
    left_out = [name for name, p in named if p.requires_grad and id(p) not in group_of]
    if left_out and comm.rank() == 0:
        warnings.warn(f"{len(left_out)} trainable parameters ({left_out[0]}, ...) are in no "
                      "parameter group: they are not trained, as in DeepSpeed (set requires_grad="
                      "False to save their gradients too)", stacklevel=3)
    return settings, group_of


def group_runs(bucket, start: int, stop: int, group_of: dict[int, int]) -> list[Run]:
    """Elements [start, stop) of a bucket (flat.Bucket: this rank's range of it), cut where the
    parameter group changes; positions relative to start. Padding and parameters in no group:
    None."""
    runs: list[Run] = []
    edges = [(off, off + p.numel(), group_of.get(id(p)))
             for p, off in zip(bucket.params, bucket.offsets)]
    edges.append((bucket.numel, bucket.padded_numel, None))                  # the padding
    for lo, hi, group in edges:
        lo, hi = max(lo, start) - start, min(hi, stop) - start
        if lo >= hi:
            continue
        if runs and runs[-1][2] == group:
            runs[-1] = (runs[-1][0], hi, group)                 # the same group goes on: one run
        else:
            runs.append((lo, hi, group))
    return runs


class OptimizerHome(Protocol):
    """Where P_os lives, as the engine, checkpoint.py and the memory meter use it: the one
    interface of ShardOptimizer (below: the device), offload.HostShardOptimizer (host memory),
    disk.DiskShardOptimizer (a file) and fsdp_engine.FlatParameters (the user's optimizer steps
    them). tests/test_architecture.py checks each has every method, with these arguments."""
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


def cache_sized(part: int, start: int, stop: int, group: int | None) -> int:
    """How ShardOptimizer cuts elements [start, stop) of part `part` (one group's run) into views:
    into this many of about VIEW_NUMEL elements [Note: cache-sized views]. A home may cut
    elsewhere (`cut`: a count or the split points, as torch.tensor_split takes them)."""
    return max(1, round((stop - start) / VIEW_NUMEL))


class ShardOptimizer:
    """Steps `param_parts` (views into the model's parameter storage) with the user's optimizer.

    param_parts: one 1-D tensor per bucket, e.g. this rank's partition of each bucket's flat
    parameters. The optimizer steps one nn.Parameter per part (the master), never the model's own
    parameters: set master.grad and call self.optimizer.step(). It sees each master as equal views
    of about VIEW_NUMEL elements (`views[i]`: the views of masters[i]) [Note: cache-sized views],
    cut where grouping's runs change group, one torch param_group per user group [Note: parameter
    groups]. placement: where each part sits (unused here). masters: where they live (offload.py:
    host memory; beyond/disk.py: a file), fp32_master's when not given. cut: how a run is cut into
    views (cache_sized).
    """

    def __init__(self, param_parts: list[torch.Tensor], optimizer_factory: OptimizerFactory,
                 grouping: Grouping | None = None, placement: Placement | None = None, *,
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
        views (zeros where a view has none: padding, parameters in no group, views another kind
        of group steps); any other (Adam's step, the same for every view) is the first stepped
        view's. param_groups: the torch optimizer's, one per user group, "params" the buckets with
        views in it."""
        saved, state = self.optimizer.state_dict(), {}
        for b, views in enumerate(self.views):
            parts = [saved["state"].get(self._index.get(id(v)), {}) for v in views]
            first = {}                                 # each state's name -> the first view with it
            for j, view_state in enumerate(parts):
                for name in view_state:
                    first.setdefault(name, j)
            if first:
                state[b] = {
                    name: torch.cat([s[name] if name in s else
                                     torch.zeros(v.shape, dtype=parts[j][name].dtype)
                                     for s, v in zip(parts, views)])
                    if _per_element(parts[j][name], views[j])
                    else parts[j][name]
                    for name, j in first.items()
                }
        bucket_of = {self._index[id(v)]: b for b, views in enumerate(self.views)
                     for v in views if id(v) in self._index}
        groups = [{**g, "params": sorted({bucket_of[i] for i in g["params"]})}
                  for g in saved["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """The inverse of state_dict(): cut each bucket's per-element state into its views. The
        groups' settings are the saved ones, in order; which views each steps is this
        optimizer's own (a resharded checkpoint cuts them elsewhere)."""
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
        return 0                      # the disk tier (beyond/disk.py) keeps its state in a file

    def master_values(self) -> list[torch.Tensor]:
        """The fp32 values of the owned parameters, one per part, wherever they live
        (for full_state_dict)."""
        return [m.detach() for m in self.masters]


def _per_element(value, like: torch.Tensor) -> bool:
    """A state with one value per element of `like` (Adam's moments, SGD's momentum)."""
    return torch.is_tensor(value) and value.shape == like.shape
