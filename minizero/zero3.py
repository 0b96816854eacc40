"""ZeRO stage 3, P_os+g+p: stage 2, plus each rank stores only its partition of the parameters.

    python -m minizero.run --stage 3 --world-size 4 [--offload | --offload params]
    engine = minizero.wrap(model, 3, functools.partial(torch.optim.AdamW, lr=1e-3), units=model.blocks)

What each rank holds (paper, section 5.3): (2 + 2 + K)Ψ/N bytes; memory falls linearly with N
(16Ψ -> 0.25Ψ for Adam with N = 64), plus the few *units* that are gathered at any moment.
Communication per step: all-gather Ψ (forward) + all-gather Ψ (backward) + reduce-scatter Ψ = 3Ψ, 1.5x
DDP: the price of not replicating parameters.

Read zero2.py first: this file is what stage 3 changes, told as what happens to a unit.
  * A unit is a module whose parameters (minus those of the units inside it) are gathered, used and freed
    together; they form one bucket (flat.py), padded and partitioned: rank r keeps partition r of every
    unit in `param_shard` [Ψ/N]; a unit's full buffer [Ψ_u] exists only while it is gathered. The model
    itself is always a unit: it owns whatever no other unit does (which units: minizero/units.py). Frozen parameters (Ψ_f: a fine-tuned
    base, LoRA's frozen weights) are partitioned the same way in a second buffer of the unit, gathered and
    freed with it, never reduced and never stepped: (Ψ + Ψ_f)·2/N bytes of parameters per rank, and
    2Ψ_f more all-gathered per step. Default units (`default_units`): a
    transformer's blocks, otherwise submodules of at most Ψ/8 parameters each; `units=` chooses them.
  * Forward: the unit's pre-forward all-gathers it (Ψ_u), its forward runs, its post-forward frees it.
  * Backward: a hook on the unit's outputs fires just before the unit's backward and gathers it again
    (Ψ_u); when the unit's gradients are complete its post-backward reduce-scatters them exactly as stage
    2 does (Zero2.reduce_scatter_grads: the unit is the bucket) and frees the full parameters.
  * Prefetch: while unit i computes, unit i+1 (in the order recorded on the first step, reversed for
    backward) is already being gathered, overlapping communication with compute (DeepSpeed's
    partitioned_param_coordinator, FSDP's forward/backward prefetch). `prefetch=False` turns it off.
  * Step: the optimizer updates param_shard in place; nothing is all-gathered after the step, the next
    forward gathers what it needs.
offload="params" (ZeRO-Infinity style) keeps param_shard in host memory; each gather copies the unit's
partition to the device first. The optimizer always steps on the host then (offload.py).
quantized_weights=True (ZeRO++ qwZ, quantize.py): forward's all-gather sends the partitions as int8 blocks,
Ψ(1 + 4/B) bytes instead of Ψ·2; backward's stays exact. quantized_gradients=True: qgZ, as in stage 2.

shard_group_size=S: partitions of S ranks, replicated across N/S groups ([Note: hierarchical sharding],
engine.py): the all-gathers and the reduce-scatter run within the shard group.

[Note: hpZ] ZeRO++'s hierarchical partitioning (hpz_group_size=R, DeepSpeed's zero_hpz_partition_size;
R = ranks_per_node): when a unit's forward all-gather completes, each rank also keeps `secondary`, the
1/R of the full unit it owns within its node's group of R ranks (engine.hpz_group). Backward's all-gather
then runs within the node from those secondaries, (R-1)/R·Ψ_u, instead of across all S (N) ranks: of the
3Ψ a step sends, only the forward all-gather and the reduce-scatter cross nodes: 3Ψ -> 2Ψ inter-node.
The price: the secondaries, Ψ/R more parameter memory from each unit's forward to its backward (freed by
its post_backward, or when backward ends), so the parameter peak at the start of backward rises by Ψ/R
(memory.secondary_partition_bytes).

[Note: recompute] Activation checkpointing (torch.utils.checkpoint, Hugging Face's
gradient_checkpointing_enable()) runs a unit's forward again inside backward, hooks included. That forward
must neither free the unit afterwards (its backward is about to use the parameters) nor prefetch in
forward order. A unit knows it is being recomputed from its training state: engine.backward() puts every
unit in PRE_BACKWARD, so a forward that starts there is a recompute, whether it comes after the unit's
pre-backward hook (non-reentrant checkpointing) or before it (reentrant: the forward ran under no_grad,
so the only pre-backward hooks are those the recompute registers). The unit is freed by post_backward.

A model built under minizero.sharded_init (construct.py) arrives as per-parameter partitions: each unit
gathers its parameters' values from them when it is built, one unit at a time, so no rank ever holds the
whole model. A unit with nothing to train (a frozen block) is gathered for its backward and freed when
backward ends: no gradient of its own tells when its backward is done.
"""

from __future__ import annotations

import time
import warnings
from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from minizero import comm, construct, quantize
from minizero.flat import Bucket, FlatLayout
from minizero.units import assign_units, default_units
from minizero.zero1 import Zero1
from minizero.zero2 import Zero2

FREE, IN_FLIGHT, GATHERED = "free", "in flight", "gathered"              # what unit.full holds
IDLE, FORWARD, PRE_BACKWARD = "idle", "forward", "pre-backward"          # where the step is, for the unit


class Unit:
    """One unit: its module, its buffers, its state, and what each hook does to it.

    full   [Ψ_u padded]  the unit's trainable parameters end to end; the module's parameters are views of
                         it. Its storage is 0 bytes while FREE (shape kept), allocated while IN_FLIGHT/GATHERED.
    shard  [Ψ_u / N]     this rank's partition, a view into the engine's param_shard: all that persists
                         between uses, updated in place by the optimizer.
    frozen_full, frozen_shard   the same for the unit's frozen parameters (empty if it has none): gathered
                         and freed with `full`, never reduced or stepped.
    training_state       IDLE -pre_forward-> FORWARD -post_forward-> IDLE; engine.backward() -> PRE_BACKWARD
                         -post_backward-> IDLE. A forward starting in PRE_BACKWARD is a recompute.
    """

    def __init__(self, engine: Zero3, module: nn.Module, name: str, bucket: Bucket | None,
                 frozen: list[nn.Parameter]):
        self.engine, self.module, self.name, self.bucket = engine, module, name, bucket
        self.params = (bucket.params if bucket else []) + list(frozen)      # what this unit owns
        self.numel = sum(p.numel() for p in self.params)
        layout, home = engine.layout, engine.param_shard.device
        self.full, self.shard = self._build(bucket, layout, lambda b: layout.shard(engine.param_shard, b))
        self.frozen_bucket = (FlatLayout.build([frozen], layout.world_size, layout.rank).buckets[0]
                              if frozen else None)
        self.frozen_full, self.frozen_shard = self._build(       # [Ψ_f,u padded], [Ψ_f,u / N] of its own
            self.frozen_bucket, layout, lambda b: torch.empty(b.shard_numel, dtype=engine.dtype, device=home))
        self.state, self.training_state = GATHERED, IDLE
        self.secondary: list[torch.Tensor] | None = None  # hpZ: [Ψ_u / R] per buffer, forward to backward
        self._in_flight: list = []                        # (all-gather handle, its input) while IN_FLIGHT
        self.free()                                       # ... which is released right away

    def _build(self, bucket: Bucket | None, layout, shard_of) -> tuple[torch.Tensor, torch.Tensor]:
        """A full buffer holding the bucket's parameters (the module's parameters become views of it) and
        this rank's partition of it; empty ones for no bucket."""
        engine = self.engine
        if bucket is None:
            empty = torch.empty(0, dtype=engine.dtype, device=engine.device)
            return empty, empty
        full = torch.zeros(bucket.padded_numel, dtype=engine.dtype, device=engine.device)
        for p, view in bucket.views(full):
            part = construct.partition_of(p)              # built by sharded_init: values from the ranks
            view.copy_(construct.full_value(p) if part else p.detach())
            construct.forget(p)
        shard = shard_of(bucket)
        shard.copy_(layout.my_partition(full, bucket))
        layout.point_bucket_into(bucket, full)
        return full, shard

    def _buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.full, self.shard), (self.frozen_full, self.frozen_shard)]

    # --- buffers --------------------------------------------------------------------------------------
    def gather(self, async_op: bool = False, forward: bool = False) -> None:
        """Materialize `full` from the N shards (async_op: only start doing so, a prefetch). forward: for
        the unit's forward, which ZeRO++'s qwZ gathers in int8 (quantized_weights; backward stays exact)."""
        if self.state == GATHERED or (self.state == IN_FLIGHT and async_op):
            return
        if self.state == FREE:
            node = self.training_state == PRE_BACKWARD and self.secondary is not None    # [Note: hpZ]
            for i, (full, shard) in enumerate(self._buffers()):
                full.untyped_storage().resize_(full.numel() * full.element_size())   # allocate
                self.engine._count("params", full.untyped_storage().nbytes())   # [Note: counted peaks]
                if node:                                  # backward: within the node, from the secondaries
                    mine, group = self.secondary[i], self.engine.hpz_group
                else:                                     # from the partitions of the shard group
                    mine, group = shard, self.engine.shard_group
                if self.engine.offload_params and not node:   # host -> device, explicit (also on a CPU run)
                    mine = mine.to(full.device, copy=True, non_blocking=True)
                if forward and self.engine.quantized_weights:           # qwZ: int8 on the wire (quantize.py)
                    handle = quantize.all_gather(full, mine, self.engine.quantization_block, async_op=True,
                                                 group=group)
                else:
                    handle = comm.all_gather(full, mine, async_op=True, group=group)  # <- the essential line of stage 3
                self._in_flight.append((handle, mine))
            self.state = IN_FLIGHT
            self.engine._record("prefetch" if async_op else "gather", self)
            if async_op:
                return
        self._wait()
        self.state = GATHERED
        if self.engine.hpz_group is not None and self.training_state == FORWARD:
            self.keep_secondary()
        self.engine._note_peak()                          # units gathered: the parameter peak

    def keep_secondary(self) -> None:
        """hpZ [Note: hpZ]: keep this rank's 1/R of the full unit (its slice within the node's group), from
        which the node rebuilds the unit for backward without crossing nodes."""
        group = self.engine.hpz_group
        i, r = comm.group_rank(group), comm.group_size(group)
        self.drop_secondary()
        self.secondary = [full[i * (full.numel() // r):][: full.numel() // r].clone() for full, _ in self._buffers()]
        self.engine._count("params", sum(t.nbytes for t in self.secondary))     # [Note: counted peaks]

    def drop_secondary(self) -> None:
        if self.secondary is not None:
            self.engine._count("params", -sum(t.nbytes for t in self.secondary))
        self.secondary = None

    def free(self) -> None:
        """Release `full`: 0 bytes, shape kept, so the parameters stay views of it."""
        if self.state == IN_FLIGHT:
            self._wait()                                  # never free a buffer a collective is writing
        if self.state != FREE:
            self.engine._record("free", self)
        for full, _ in self._buffers():
            self.engine._count("params", -full.untyped_storage().nbytes())
            full.untyped_storage().resize_(0)
        self.state = FREE

    def _wait(self) -> None:
        for handle, _ in self._in_flight:
            handle.wait()
        self._in_flight = []

    def keep_written(self) -> None:
        """The full parameters were written (engine.gathered(modifier_rank=...)): keep this rank's part."""
        for full, shard in self._buffers():
            if full.numel():
                shard.copy_(full[self.engine.layout.rank * shard.numel():][: shard.numel()])

    def reduce_scatter_grads(self):
        """Stage 2's reduce-scatter of this unit's gradients (Zero2.reduce_scatter_grads): the async handle."""
        return self.engine.reduce_scatter_grads(self.bucket)

    # --- lifecycle: Zero3 calls these from the module's forward hooks and from autograd ------------------
    def pre_forward(self) -> None:
        if self.training_state == PRE_BACKWARD:           # backward recomputes this forward [Note: recompute]
            self.gather()                                 # reentrant: its first use in this backward
            return
        self.training_state = FORWARD
        self.gather(forward=True)
        self.engine._prefetch_after(self, self.engine.forward_order)

    def post_forward(self) -> None:
        if self.training_state == PRE_BACKWARD:           # a recompute: its backward needs the parameters
            return
        self.training_state = IDLE
        self.free()                                       # <- stage 3's saving: free after forward

    def pre_backward(self) -> None:
        """The gradient of the unit's output is known: its backward is next, and the backward of every
        unit that used that output is done (see post_backward)."""
        self.engine.free_finished()
        self.training_state = PRE_BACKWARD
        self.gather()
        self.engine._prefetch_after(self, self.engine.backward_order)

    def post_backward(self):
        """Every trainable gradient of the unit is complete: reduce-scatter them, free the parameters; the
        handle. A unit with frozen parameters may still need them then: its input's gradient can flow
        through a frozen weight after the last trainable gradient is done (LoRA: the adapters' gradients
        come before the frozen layer norm in front of them is differentiated). Such a unit is freed when the
        next unit's backward starts (pre_backward) or backward ends."""
        handle = self.reduce_scatter_grads()
        self.training_state = IDLE
        self.drop_secondary()                             # hpZ: its backward all-gather is done
        if self.frozen_bucket is None:
            self.free()
        else:
            self.engine.finished.append(self)
        return handle


class Zero3(Zero2):
    """Builds the units, connects the model's forward hooks and autograd to their lifecycle, and runs
    stage 2's reducer with one bucket per unit."""
    stage = 3
    offload_choices = (False, True, "optimizer", "params", "disk")
    unit_class = Unit        # what units are made of: exercise 5's grader brings a Unit with the learner's hooks

    def __init__(self, model, optimizer, *, units: list[nn.Module] | None = None, prefetch: bool = True,
                 quantized_weights: bool = False, quantized_gradients: bool = False,
                 quantization_block: int = quantize.BLOCK, **kwargs):
        self.prefetch = prefetch
        self.quantized_weights = quantized_weights                 # ZeRO++ qwZ, qgZ: quantize.py
        self.quantized_gradients, self.quantization_block = quantized_gradients, quantization_block
        self.offload_params = kwargs.get("offload") == "params"
        self.timeline: list[tuple[float, str, int]] | None = None       # set to [] to record events
        chosen = default_units(model) if units is None else units
        self._unit_modules, self._unit_params, self._unit_frozen = assign_units(model, chosen)
        # Not Zero2.__init__: its bucket_size means nothing here (stage 3's buckets are units).
        Zero1.__init__(self, model, optimizer, **kwargs)
        self.finished: list[Unit] = []          # backward done, frozen parameters still gathered (post_backward)
        self._gathered_for_user: list[list[Unit]] = []          # by engine.gathered(), innermost last
        self.forward_order: list[Unit] = []     # pre-forward order, recorded on the first step
        self.backward_order: list[Unit] = []    # reverse post-forward order: the order backward runs units
        for unit in self.units:
            unit.module.register_forward_pre_hook(partial(self._on_pre_forward, unit))
            unit.module.register_forward_hook(partial(self._on_post_forward, unit))
        largest = max(self.units, key=lambda unit: unit.numel)
        share = largest.numel / sum(unit.numel for unit in self.units)
        if units is not None and share > 0.5:     # gathered whole, it is most of the model: little saved
            warnings.warn(f"stage 3: unit {largest.name!r} holds {share:.0%} of the parameters; pass units= "
                          "with smaller submodules (e.g. each block)", stacklevel=3)

    @property
    def unit_names(self) -> list[str]:
        return [unit.name for unit in self.units]         # by unit index (as in timeline events)

    def _param_groups(self):
        return [group for group in self._unit_params if group]      # one bucket per unit that trains

    # --- parameters: only this rank's partition persists; each unit holds its full buffer ----------------
    def _init_parameters(self) -> None:
        home = torch.device("cpu") if self.offload_params else self.device
        pin = self.offload_params and self.device.type == "cuda"
        self.param_shard = torch.empty(self.layout.shard_numel, dtype=self.dtype, device=home,
                                       pin_memory=pin)                          # [Ψ/N]
        names = {id(m): name or "<root>" for name, m in self.module.named_modules()}
        buckets = iter(self.layout.buckets)
        self.units = [self.unit_class(self, m, names[id(m)], next(buckets) if trains else None, frozen)
                      for m, trains, frozen in zip(self._unit_modules, self._unit_params, self._unit_frozen)]
        self._unit_of_bucket = {unit.bucket.index: unit for unit in self.units if unit.bucket is not None}
        for i, unit in enumerate(self.units):
            unit.index = i

    def _my_params(self, b) -> torch.Tensor:
        return self._unit_of_bucket[b.index].shard        # the optimizer updates the shard in place

    # --- hooks: the model's modules and autograd drive each unit's lifecycle ------------------------------
    def _on_pre_forward(self, unit: Unit, module, args) -> None:
        if unit not in self.forward_order:
            self.forward_order.append(unit)
        unit.pre_forward()

    def _on_post_forward(self, unit: Unit, module, args, output) -> None:
        if unit not in self.backward_order:
            self.backward_order.insert(0, unit)
        unit.post_forward()
        if torch.is_grad_enabled():                       # backward will need the parameters again
            for t in tree_flatten(output)[0]:                # tensors in tuples, dicts, ModelOutputs
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(lambda grad: unit.pre_backward())

    def _prefetch_after(self, unit: Unit, order: list[Unit]) -> None:
        # the next unit's all-gather runs while this one computes
        following = order.index(unit) + 1
        if self.prefetch and following < len(order):
            order[following].gather(async_op=True, forward=order is self.forward_order)

    def _record(self, event: str, unit: Unit) -> None:
        if self.timeline is not None:   # (time, "gather" | "prefetch" | "free", bucket index)
            self.timeline.append((time.perf_counter(), event, unit.index))

    # --- backward -----------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        for unit in self.units:                           # a forward from here on is a recompute
            unit.training_state = PRE_BACKWARD            # [Note: recompute]
        super().backward(loss)

    def _bucket_ready(self, b):
        return self._unit_of_bucket[b.index].post_backward()      # the reducer calls it in bucket order

    def free_finished(self) -> None:
        """Free the units whose backward is done but whose frozen parameters were kept (post_backward)."""
        for unit in self.finished:
            unit.free()
        self.finished.clear()

    def _after_backward(self) -> None:
        super()._after_backward()                         # post_backward of units that got no gradient
        self.finished.clear()
        for unit in self.units:                           # and units a prefetch gathered after it
            unit.free()
            unit.training_state = IDLE
            unit.drop_secondary()                         # hpZ: units with nothing to train keep it till now

    # --- step: nothing to gather, the shards were updated in place ---------------------------------------
    def _after_step(self) -> None:
        pass

    # --- engine.gathered(): the units holding the parameters asked for -----------------------------------
    def _units_of(self, params) -> list[Unit]:
        wanted = {id(p) for p in params}
        return [u for u in self.units if any(id(p) in wanted for p in u.params)]

    def _gather_for_user(self, params) -> None:
        # only the units that are free now: a nested gathered() (full_state_dict inside one) keeps the outer's
        newly = [unit for unit in self._units_of(params) if unit.state == FREE]
        for unit in newly:
            unit.gather()
        self._gathered_for_user.append(newly)

    def _after_user_write(self, params) -> None:
        for unit in self._units_of(params):
            unit.keep_written()
        super()._after_user_write(params)                  # the masters follow the shards

    def _release_for_user(self, params) -> None:
        for unit in self._gathered_for_user.pop():
            unit.free()

    def _extra_tensors(self, category):
        shard_category = "offloaded" if self.offload_params else "params"
        extra = super()._extra_tensors(category)
        if category == shard_category:
            extra = extra + [self.param_shard] + [u.frozen_shard for u in self.units]
        if category == "params":                          # hpZ's secondaries live on the device
            extra = extra + [t for u in self.units for t in (u.secondary or [])]
        return extra
