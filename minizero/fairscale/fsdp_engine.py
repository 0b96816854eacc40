"""Stage 3 whose optimizer is the user's: the engine under minizero.FullyShardedDataParallel (read
fairscale/fsdp.py first, then zero3.py: this file is only what FairScale's way changes).

    python -m pytest tests/test_fsdp.py tests/test_fairscale_scenarios.py

  * parameters(): one nn.Parameter per unit, FairScale's FlatParameter: this rank's partition of the
    unit's flattened parameters [Ψ_u / N], sharing storage with the engine's parameter shard. An
    optimizer step on them is a step on the shard the next gather reads. The model's own parameters
    stay views of the units' full buffers (freed between uses) and are not the wrapper's parameters.
  * loss.backward(): no engine.backward() to call, so the engine finds backward's start and end
    itself: a hook on the model's output (its gradient is the first thing backward computes) and a
    callback queued on autograd's engine for when backward is done (FSDP does the same). Both hang
    on the model itself, a unit or not (an nn.Sequential owns no parameter). At the end the
    reduce-scatters are finished and each FlatParameter's .grad holds its part of the gradient
    shard, averaged over the N ranks, added to what .grad held (no zero_grad(): accumulation).
  * reshard_after_forward=True frees each unit after its forward (stage 3); False keeps it gathered
    from its forward to its backward (stage 2's parameter memory during the step, Ψ/N between
    steps). disable_reshard_on_root=True (FairScale's default) keeps the root's own unit so.
  * mixed_precision=True (FairScale's flag): the model computes in compute_dtype (default fp16),
    gradients are reduced in it (fp32_reduce_scatter=True: in fp32); the FlatParameters are fp32
    *masters* of the 16-bit partitions, taken from the model's fp32 values, and the user's
    optimizer.step() updates those. The partitions are refreshed from them when the next forward
    starts, the one moment every step passes through before the parameters are read. No loss
    scaling (FairScale leaves that to ShardedGradScaler). A 16-bit compute_dtype without
    mixed_precision is FairScale's pure 16-bit mode: FlatParameters in that dtype, no masters.
  * clip_grad_norm_(max_norm, norm_type): the norm over all N partitions.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import replace
from functools import partial

import torch
from torch import nn

from minizero import comm, owners
from minizero.assembled import Zero3

class FlatParameters:
    """What sits in the engine's optimizer slot: the FlatParameters the user's optimizer steps, one
    per partition the engine hands its optimizer (one per unit that trains). In fp32 they share
    storage with the partitions (no copy); with 16-bit partitions they are fp32 masters of them,
    copied into the partitions by refresh(). The optimizer's state is the user's."""

    def __init__(self, parts: list[torch.Tensor], masters: bool = True):
        self.param_parts = parts          # masters=False: FairScale's pure 16-bit mode, no copies
        self.params = [nn.Parameter(part if part.dtype == torch.float32 or not masters
                                    else part.float())
                       for part in parts]            # fp32: views of the shard; else [Ψ_u/N] fp32

    def _masters(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(master, its partition) where they are separate tensors (16-bit partitions)."""
        return [(p, part) for p, part in zip(self.params, self.param_parts)
                if p.data_ptr() != part.data_ptr()]

    def refresh(self) -> None:
        """The partitions take the masters' values, rounded (what ShardOptimizer.step does)."""
        with torch.no_grad():
            for master, part in self._masters():
                part.copy_(master)

    def reload(self) -> None:
        """The partitions were written (load_state_dict, summon_full_params): the masters take the
        values that changed; an element written with its own value keeps its fp32 master."""
        with torch.no_grad():
            for master, part in self._masters():
                changed = master.to(part.dtype) != part
                master[changed] = part[changed].float()

    def master_values(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.params]

    def device_tensors(self) -> list[torch.Tensor]:
        return [master for master, _ in self._masters()]       # the 4 of 2 + 4 + K

    def host_tensors(self) -> list[torch.Tensor]:
        return []

    def disk_bytes(self) -> int:
        return 0                                  # the user's optimizer keeps its state in memory


def _the_users_optimizer(parts, factory, grouping, placement):
    return factory(parts)                 # FlatParameters: the user's optimizer steps them


class FSDPEngine(Zero3):
    """Stage 3 whose optimizer is the user's: backward is driven by autograd alone (see the module's
    top)."""
    row = replace(Zero3.row, optimizer=_the_users_optimizer)
    # FairScale's shared weights across instances: each holds its partitions until an outer one
    # adopts both (fairscale/fsdp.py's _borrowed)
    owner_kind = "minizero.FullyShardedDataParallel"
    composes_with = (owner_kind,)

    def __init__(self, module: nn.Module, kept: dict[int, bool], keep_others: bool,
                 masters: bool, fp32_buffers: bool = False, **options):
        fp32 = {}                       # mixed precision: rank 0's fp32 values, for the masters
        if masters and options["dtype"] != "fp32":
            fp32 = {id(p): p.data for p in module.parameters() if p.requires_grad}
        buffers = [(name, b.data) for name, b in module.named_buffers() if b.is_floating_point()] \
            if fp32_buffers else []                      # buffer_dtype=torch.float32: kept so
        for value in [*fp32.values(), *(value for _, value in buffers)]:
            comm.broadcast(value, src=0, tag="rank 0's fp32 values")
        # the "optimizer" the engine builds
        super().__init__(module, partial(FlatParameters, masters=masters), **options)
        # id(unit module) -> it stays gathered from forward to backward (inner FSDPs, the root);
        # the other units (default_units, units=): keep_others
        self.kept, self.keep_others = kept, keep_others
        if fp32:
            self._take_masters(fp32)
        for name, value in buffers:            # model.to() replaced the buffers: found by name
            module.get_buffer(name).data = value
        self.retired = False
        for p in module.parameters():
            p._fsdp_owner = weakref.ref(self)      # the FSDP engine holding it (_borrowed)
        # where a step starts and where backward starts: the model's, a unit or not
        self.params.hooks += [module.register_forward_pre_hook(self._step_starts, prepend=True)]

    def _take_masters(self, fp32: dict[int, torch.Tensor]) -> None:
        """16-bit partitions: the fp32 masters start from the model's fp32 values, not from their
        rounding (FairScale's fp32 shards)."""
        for p, b in zip(self.optimizer.params, self.layout.buckets):
            if p.data_ptr() != self.layout.shard(self.params.shard, b).data_ptr():
                full = torch.zeros(b.padded_numel, dtype=torch.float32, device=self.device)
                for param, view in b.views(full):
                    view.copy_(fp32[id(param)])
                p.data.copy_(self.layout.my_partition(full, b))

    def keeps_gathered(self, unit) -> bool:
        """reshard_after_forward=False: the unit stays gathered from its forward to its backward
        (a forward without autograd frees it anyway: no backward will)."""
        return self.kept.get(id(unit.module), self.keep_others)

    def retire(self) -> dict[str, torch.Tensor]:
        """Hand the model over (to an outer FSDP): its full state (fp32 masters), every hook of
        this engine removed. Collective."""
        state = self.full_state_dict()
        self.retired = True
        for handle in self.params.hooks + self.reducer.hooks + self.hooks:   # forward, gradient
            handle.remove()
        owners.release(self.module.parameters(), self.owner)
        return state

    def _step_starts(self, module, args) -> None:
        if not self._in_backward:                 # not a recompute ([Note: recompute], units.py)
            self.optimizer.refresh()       # 16-bit partitions from the masters the user stepped

    def _grad_of(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(FlatParameter, its part of the gradient shard), bucket by bucket."""
        return [(p, self.layout.shard(self.grads.shard, b))
                for p, b in zip(self.optimizer.params, self.layout.buckets)]

    def _backward_starts(self, grad: torch.Tensor) -> None:
        """[Note: loss.backward()] in assembled.py; the user's optimizer steps, so no mid_step."""
        if self._in_backward:
            return
        self._in_backward = True
        self.params.before_backward()             # a forward from here on is a recompute
        for p, part in self._grad_of():
            if p.grad is None or p.grad.data_ptr() != part.data_ptr():
                part.zero_()     # the reduce-scatters add into it; _backward_ends adds it to .grad
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)

    def _backward_ends(self) -> None:
        self._in_backward = False
        self.end_backward()                # finish the reduce-scatters, free the units
        for p, part in self._grad_of():
            if p.grad is None:             # fp32: the shard itself, accumulated into in place
                p.grad = part if part.dtype == p.dtype else part.float()
            elif p.grad.data_ptr() != part.data_ptr():
                p.grad.add_(part)          # a .grad the user set, or fp32 over 16-bit reductions
        self.meter.measure()

    def _tensors_by_category(self):
        tensors = super()._tensors_by_category()
        # fp32 .grad over 16-bit reductions: tensors of their own
        tensors["grads"] += [p.grad for p in self.optimizer.params]
        return tensors

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every FlatParameter's .grad so that the global p-norm (over all N partitions) is at
        most max_norm; returns the norm before clipping (torch.nn.utils.clip_grad_norm_ on the whole
        model). Padding is zero: it adds nothing to any norm."""
        norm_type = float(norm_type)
        grads = [p.grad for p in self.optimizer.params if p.grad is not None]
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if norm_type == math.inf:                      # the largest |g| on any rank
            for g in grads:
                total = torch.maximum(total, g.detach().float().abs().max())
            comm.all_reduce(total, op="max", group=self.shard_group, tag="gradient norm")
        else:                                          # (Σ over ranks of Σ |g|^p)^(1/p)
            for g in grads:
                total += g.detach().float().abs().pow(norm_type).sum()
            comm.all_reduce(total, op="sum", group=self.shard_group, tag="gradient norm")
            total = total ** (1.0 / norm_type)
        scale = max_norm / (total + 1e-6)
        if scale < 1:
            for g in grads:
                g.detach().mul_(scale.to(g.dtype))
        return total
