"""The user's parameter groups, as the engine's optimizer sees them ([Note: parameter groups] in
optim.py).

    engine = minizero.wrap(model, 2, optimizer, param_groups=[
        {"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
    python -m pytest tests/test_param_groups.py

torch's param_groups (Hugging Face's "no weight decay on biases and norms", a lower lr for the
embeddings) give parameters their own lr, weight_decay, betas, eps, any key. DeepSpeed keeps one
flat fp32 buffer per group, partitioned over the ranks. minizero keeps its flat layout as it is and
cuts each bucket's elements into *runs* where the group changes (group_runs, from the bucket's
parameter offsets and this rank's range of it); optim.ShardOptimizer steps each run with its
group's settings. Trainable parameters that are in no group are not trained, as in DeepSpeed, which
builds its optimizer over the groups only (their gradients are still reduced; one warning line).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from minizero import comm

# A run of a master's elements: (start, stop, index of its parameter group, or None: not stepped)
Run = tuple[int, int, "int | None"]


@dataclass
class Grouping:
    """The user's param groups as one rank's optimizer sees them ([Note: parameter groups] in
    optim.py): an optimizer home's `grouping`."""
    settings: list[dict]       # each group's hyperparameters (no "params"), in the user's order
    runs: list[list[Run]]      # for each part: its elements cut where the group changes
    group_of: dict[int, int]   # {id(parameter): its group}, every rank's parameters


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


@dataclass(frozen=True)
class ParamGroups:
    """The engine's policy for param_groups=: each group's settings, and {id(param): its group}."""
    settings: list[dict]
    group_of: dict[int, int]

    @classmethod
    def parse(cls, param_groups, named: list[tuple[str, nn.Parameter]]) -> ParamGroups:
        return cls(*parse_param_groups(param_groups, named))

    def grouping(self, engine) -> Grouping:
        """For each bucket, the runs of its elements this rank's optimizer steps (its partition, or
        the whole bucket unsharded), cut where the group changes."""
        runs = []
        for b in engine.layout.buckets:
            start = engine.layout.rank * b.shard_numel if engine.sharded else 0
            size = b.shard_numel if engine.sharded else b.padded_numel
            runs.append(group_runs(b, start, start + size, self.group_of))
        return Grouping(self.settings, runs, self.group_of)
