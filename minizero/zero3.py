"""ZeRO stage 3, P_os+g+p: stage 2, plus each rank stores only its partition of the parameters.

    python -m minizero.run --stage 3 --world-size 4 [--offload | --offload params]
    engine = minizero.wrap(model, 3, functools.partial(torch.optim.AdamW, lr=1e-3), units=model.blocks)

What each rank holds (paper, section 5.3): (2 + 2 + K)Ψ/N bytes; memory falls linearly with N
(16Ψ -> 0.25Ψ for Adam with N = 64), plus the few *units* that are gathered at any moment.

Read zero2.py first: this file is only what stage 3 changes.
  * Units. The model is cut into units (default: the blocks of its first nn.ModuleList, plus the root,
    the model itself, holding everything else). Each unit's parameters form one bucket (flat.py), padded
    and partitioned: rank r keeps partition r of every unit in `param_shard` [Ψ/N]; the full bucket
    buffer of a unit exists only while the unit is gathered. A parameter used by two units (the GPT's
    embedding tied to its output head) belongs to the innermost unit containing both uses, so it is
    gathered for as long as either use needs it: no hang, no stale copy.
  * Forward: a pre-hook all-gathers the unit (Ψ_u), its forward runs, a post-hook frees it.
  * Backward: a hook on the unit's outputs fires just before the unit's backward and gathers it again
    (Ψ_u); when the unit's gradients are complete they are reduce-scattered exactly as in stage 2 (the
    unit is the bucket) and the full parameters are freed.
  * Prefetch: while unit i computes, unit i+1 (in the order recorded on the first step, reversed for
    backward) is already being gathered, overlapping communication with compute (DeepSpeed's
    partitioned_param_coordinator, FSDP's forward/backward prefetch). `prefetch=False` turns it off.
  * Step: the optimizer updates param_shard in place; nothing is all-gathered after the step, the next
    forward gathers what it needs.
Communication per step: all-gather Ψ (forward) + all-gather Ψ (backward) + reduce-scatter Ψ = 3Ψ, 1.5x
DDP: the price of not replicating parameters.
offload="params" (ZeRO-Infinity style) keeps param_shard in host memory; each gather copies the unit's
partition to the device first. The optimizer always steps on the host then (offload.py).

Limitation (as FSDP without meta-device init): the model is built in full on each rank before wrapping.
"""

from __future__ import annotations

import time
from functools import partial

import torch
from torch import nn

from minizero import comm
from minizero.zero2 import Zero2

FREE, IN_FLIGHT, GATHERED = "free", "in flight", "gathered"


class Zero3(Zero2):
    stage = 3
    offload_choices = (False, True, "optimizer", "params")

    def __init__(self, model, optimizer, *, units: list[nn.Module] | None = None, prefetch: bool = True,
                 **kwargs):
        self.prefetch = prefetch
        self.offload_params = kwargs.get("offload") == "params"
        self._unit_spec = units
        self.timeline: list[tuple[float, str, int]] | None = None       # set to [] to record events
        super().__init__(model, optimizer, **kwargs)
        for b, unit in zip(self.layout.buckets, self.unit_modules):
            unit.register_forward_pre_hook(partial(self._pre_forward, b))
            unit.register_forward_hook(partial(self._post_forward, b))
        self._forward_order: list = []       # buckets in pre-forward order, recorded on the first step
        self._finished_order: list = []      # buckets in post-forward order; reversed = backward order
        names = {id(m): n or "<root>" for n, m in self.module.named_modules()}
        self.unit_names = [names[id(u)] for u in self.unit_modules]     # by bucket index

    def _record(self, event: str, b) -> None:
        if self.timeline is not None:   # (time, "gather" | "prefetch" | "free", bucket index)
            self.timeline.append((time.perf_counter(), event, b.index))

    # --- units: which parameters each one owns ------------------------------------------------------------
    def _param_groups(self):
        model = self.module
        spec = self._unit_spec if self._unit_spec is not None else _default_units(model)
        units = [model] + [u for u in spec if u is not model]
        members = {id(u): {id(m) for m in u.modules()} for u in units}
        holders: dict[int, list[nn.Module]] = {}           # parameter -> modules that hold it directly
        for m in model.modules():
            for p in m._parameters.values():
                if p is not None:
                    holders.setdefault(id(p), []).append(m)
        owned: dict[int, list] = {id(u): [] for u in units}
        for p in self.trainable:
            # the innermost unit that contains every module using p (a tied weight: their common ancestor)
            owner = min((u for u in units if all(id(h) in members[id(u)] for h in holders[id(p)])),
                        key=lambda u: len(members[id(u)]))
            owned[id(owner)].append(p)
        # Bucket order = reverse registration order: the order in which backward completes units (the root
        # last, since the tied embedding's gradient is finished only at the very end).
        kept = [u for u in reversed(units) if owned[id(u)]]
        self.unit_modules = kept
        return [owned[id(u)] for u in kept]

    # --- parameters: only this rank's partition persists ----------------------------------------------
    def _init_parameters(self) -> None:
        home = torch.device("cpu") if self.offload_params else self.device
        pin = self.offload_params and self.device.type == "cuda"
        self.param_shard = torch.empty(self.layout.shard_numel, dtype=self.dtype, device=home,
                                       pin_memory=pin)                          # [Ψ/N]
        self.full_params: dict[int, torch.Tensor] = {}    # bucket -> [Ψ_u padded], storage 0 when free
        self._state: dict[int, str] = {}
        self._pending: dict[int, tuple] = {}              # bucket -> (handle, device copy of partition)
        for b in self.layout.buckets:
            full = torch.zeros(b.padded_numel, dtype=self.dtype, device=self.device)
            for p, view in b.views(full):
                view.copy_(p.detach())
            self.layout.shard(self.param_shard, b).copy_(self.layout.my_partition(full, b))
            self.layout.point_bucket_into(b, full)        # parameters become views of the unit buffer
            self.full_params[b.index] = full
            self._state[b.index] = GATHERED
            self._free(b)                                 # ... which is released right away

    def _my_params(self, b) -> torch.Tensor:
        return self.layout.shard(self.param_shard, b)    # the optimizer updates the shard in place

    def _gather(self, b, async_op: bool = False) -> None:
        """Make unit b's full parameters available (or, async_op, start doing so: a prefetch)."""
        state = self._state[b.index]
        if state == GATHERED or (state == IN_FLIGHT and async_op):
            return
        if state == IN_FLIGHT:
            self._pending.pop(b.index)[0].wait()
        else:
            full = self.full_params[b.index]
            full.untyped_storage().resize_(full.numel() * full.element_size())   # allocate [Ψ_u padded]
            mine = self.layout.shard(self.param_shard, b)
            if self.offload_params:
                mine = mine.to(self.device, copy=True, non_blocking=True)      # host -> device, explicit
            handle = comm.all_gather(full, mine, async_op=True)     # <- the essential line of stage 3
            self._record("prefetch" if async_op else "gather", b)
            if async_op:
                self._pending[b.index] = (handle, mine)
                self._state[b.index] = IN_FLIGHT
                return
            handle.wait()
        self._state[b.index] = GATHERED
        self._track_peak()

    def _free(self, b) -> None:
        if self._state[b.index] == IN_FLIGHT:
            self._pending.pop(b.index)[0].wait()          # never free a buffer a collective is writing
        if self._state[b.index] != FREE:
            self._record("free", b)
        self.full_params[b.index].untyped_storage().resize_(0)
        self._state[b.index] = FREE

    # --- forward hooks ----------------------------------------------------------------------------------
    def _pre_forward(self, b, module, args) -> None:
        if b not in self._forward_order:
            self._forward_order.append(b)
        self._gather(b)
        self._prefetch_after(b, self._forward_order)

    def _post_forward(self, b, module, args, output) -> None:
        if b not in self._finished_order:
            self._finished_order.append(b)
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(partial(self._pre_backward, b))
        self._free(b)

    # --- backward hooks ---------------------------------------------------------------------------------
    def _pre_backward(self, b, grad) -> None:
        """Fires when the gradient of the unit's output is known, i.e. just before the unit's backward."""
        self._gather(b)
        self._prefetch_after(b, self._finished_order[::-1])

    def _prefetch_after(self, b, order: list) -> None:
        if self.prefetch and b in order and order.index(b) + 1 < len(order):
            self._gather(order[order.index(b) + 1], async_op=True)

    def _reduce_scatter_bucket(self, b):
        handle = super()._reduce_scatter_bucket(b)       # stage 2: stage, free p.grad, reduce-scatter
        self._free(b)                                    # the unit's backward is done: drop full params
        return handle

    def _after_backward(self) -> None:
        super()._after_backward()
        for b in self.layout.buckets:                    # units whose backward never ran (unused)
            if self._state[b.index] != FREE:
                self._free(b)

    # --- step: nothing to gather, the shards were updated in place ---------------------------------------
    def _after_step(self) -> None:
        pass

    def _extra_tensors(self, category):
        shard_category = "offloaded" if self.offload_params else "params"
        extra = super()._extra_tensors(category)
        return extra + [self.param_shard] if category == shard_category else extra


def _default_units(model: nn.Module) -> list[nn.Module]:
    """The modules of the first nn.ModuleList (a transformer's blocks), like FSDP's per-layer wrapping."""
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            return list(m)
    return []


def _tensors(output) -> list[torch.Tensor]:
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []
