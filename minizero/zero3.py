"""ZeRO stage 3, P_os+g+p: stage 2, plus each rank stores only its partition of the parameters.

    python -m minizero.run --stage 3 --world-size 4 [--offload | --offload params]
    engine = minizero.wrap(model, 3, functools.partial(torch.optim.AdamW, lr=1e-3))

What each rank holds (paper, section 5.3): (2 + 2 + K)Ψ/N bytes (16Ψ -> 0.25Ψ for Adam, N = 64),
plus the few *units* gathered at any moment. Per step: all-gather Ψ (forward) + all-gather Ψ
(backward) + reduce-scatter Ψ = 3Ψ, 1.5x DDP: the price of not replicating parameters.

Read zero2.py first; this file is what happens to a unit (unit.py: the Unit; units.py: which ones).
  * A unit's parameters are one bucket (flat.py); rank r keeps its partition of every unit in
    `param_shard` [Ψ/N]; a unit's full buffer [Ψ_u] exists only while gathered. Frozen parameters
    (Ψ_f: LoRA's base) are partitioned alike and never reduced: (Ψ + Ψ_f)·2/N bytes per rank.
  * Forward: the unit's pre-forward all-gathers it, its forward runs, its post-forward frees it.
  * Backward: a hook on its outputs gathers it again just before its backward; when its gradients
    are complete, post-backward reduce-scatters them as stage 2 does (the unit is the bucket).
  * Prefetch: while unit i computes, unit i+1 (in the order of the first step) is being gathered.
  * Step: the optimizer updates param_shard in place; the next forward gathers what it needs.
Variants are routes (comm.Route, _init_parameters): offload="params" (the shard on the host),
quantized_weights (ZeRO++ qwZ), shard_group_size ([Note: hierarchical sharding] in engine.py).
[Note: hpZ] ZeRO++'s hpz_group_size=R: a unit's forward all-gather also leaves each rank its 1/R of
the unit within its node (`secondary`), so backward's all-gather stays inside the node: 3Ψ -> 2Ψ
across nodes, for Ψ/R more parameter memory until backward.
[Note: recompute] Activation checkpointing runs a unit's forward again in backward, which must
neither free it nor prefetch: engine.backward() puts every unit in PRE_BACKWARD, so a forward
starting there is a recompute (reentrant or not).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from minizero import comm, construct
from minizero.flat import Bucket, FlatLayout, partition
from minizero.unit import IDLE, PRE_BACKWARD, ParameterWriteError, Unit, UnitRoutes
from minizero.units import assign_units, default_units
from minizero.zero2 import Zero2


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}   # by bytes


class Zero3(Zero2):
    """Builds the units, connects the model's forward hooks and autograd to their lifecycle, and
    runs stage 2's reducer with one bucket per unit."""
    stage = 3
    unit_class = Unit       # what units are made of: exercise 7's grader brings the learner's hooks

    def __init__(self, model, optimizer, *, units: list[nn.Module] | None = None,
                 prefetch: bool = True, quantized_weights: bool = False, **kwargs):
        self.prefetch, self.quantized_weights = prefetch, quantized_weights    # qwZ: quantize.py
        chosen = default_units(model) if units is None else units
        self._unit_modules, self._unit_params, self._unit_frozen = assign_units(
            model, chosen, chosen=units is not None)
        self.finished: list[Unit] = []          # backward done, frozen parameters still gathered
        self._gathered_for_user: list[list[Unit]] = []     # by engine.gathered(), innermost last
        self.forward_order: list[Unit] = []     # pre-forward order, recorded on the first step
        self.backward_order: list[Unit] = []    # reverse post-forward order: backward's order
        self._in_forward: list[Unit] = []       # units whose forward runs, innermost last
        self._returned: dict[int, list[Unit]] = {}  # [Note: returned parameters]
        super().__init__(model, optimizer, **kwargs)       # stage 2, with one bucket per unit
        self._unit_of_param = {id(p): u for u in self.units for p in u.params}
        self.hooks = []                         # their handles: fsdp.py hands a model over
        for unit in self.units:
            self.hooks += [
                unit.module.register_forward_pre_hook(partial(self._on_pre_forward, unit)),
                unit.module.register_forward_hook(partial(self._on_post_forward, unit))]
        # [Note: returned parameters]
        self.hooks.append(model.register_forward_hook(self._on_model_forward_end))

    def _param_groups(self):
        return [group for group in self._unit_params if group]     # one bucket per unit that trains

    def bucket_tag(self, b: Bucket) -> str:
        return self._unit_of_bucket[b.index].tag

    # --- parameters: only this rank's partition persists; each unit holds its full buffer --------
    def _init_parameters(self) -> None:
        host = self.offload == "params"                # ZeRO-Infinity style: the shard on the host
        home = torch.device("cpu") if host else self.device
        pin = host and self.device.type == "cuda"      # pinned: host -> device copies run async
        self.param_shard = torch.empty(self.layout.shard_numel, dtype=self.dtype, device=home,
                                       pin_memory=pin)                                  # [Ψ/N]
        # the variants are routes, not branches ([Note: hierarchical sharding], [Note: hpZ])
        exact = comm.Route(self.shard_group, home="host" if host else "device")
        int8 = self.int8_codec(self.quantization_block)
        forward = comm.Route(exact.group, int8, exact.home) if self.quantized_weights else exact
        node = None if self.hpz_group is None else comm.Route(self.hpz_group)
        names = {id(m): name or "<root>" for name, m in self.module.named_modules()}
        buckets, self.units = iter(self.layout.buckets), []
        owned = zip(self._unit_modules, self._unit_params, self._unit_frozen)
        for i, (module, trains, frozen) in enumerate(owned):
            bucket = next(buckets) if trains else None
            frozen_bucket = FlatLayout.build([frozen], self.layout.world_size,
                                             self.layout.rank).buckets[0] if frozen else None
            buffers = [self._unit_buffers(bucket, lambda b: self.layout.shard(self.param_shard, b)),
                       self._unit_buffers(frozen_bucket, lambda b: torch.empty(   # [Ψ_f,u / N]
                           b.shard_numel, dtype=self.dtype, device=home, pin_memory=pin))]
            self.units.append(self.unit_class(self, module, names[id(module)], i,
                                              UnitRoutes(forward, exact, node), bucket, buffers,
                                              frozen_bucket))
        self._unit_of_bucket = {u.bucket.index: u for u in self.units if u.bucket is not None}
        self.unit_names = [unit.name for unit in self.units]      # by index, as in unit events

    def _unit_buffers(self, bucket: Bucket | None, shard_of) -> tuple[torch.Tensor, torch.Tensor]:
        """The unit's full buffer [Ψ_u padded] (its parameters views of it; sharded_init's values
        gathered from the ranks) and this rank's partition of it; empty ones for no bucket."""
        if bucket is None:
            empty = torch.empty(0, dtype=self.dtype, device=self.device)
            return empty, empty
        full = self.layout.flatten_bucket(bucket, self.dtype, self.device, construct.take_value)
        shard = shard_of(bucket)
        shard.copy_(self.layout.my_partition(full, bucket))
        return full, shard

    def _my_params(self, b) -> torch.Tensor:
        return self._unit_of_bucket[b.index].shard     # the optimizer updates the shard in place

    # --- hooks: the model's modules and autograd drive each unit's lifecycle ---------------------
    def _on_pre_forward(self, unit: Unit, module, args) -> None:
        if unit not in self.forward_order:
            self.forward_order.append(unit)
        self._in_forward.append(unit)
        unit.pre_forward()

    def _on_post_forward(self, unit: Unit, module, args, output) -> None:
        if unit not in self.backward_order:
            self.backward_order.insert(0, unit)
        outputs = tree_flatten(output)[0]              # tensors in tuples, dicts, ModelOutputs
        if self._in_forward and self._in_forward[-1] is unit:
            self._in_forward.pop()
        kept = self._keep_returned(outputs)
        held, unit.held = unit.held, unit.held or unit in kept    # kept: post_forward won't free
        unit.post_forward()
        unit.held = held
        self._free_returned(id(unit), kept)            # what units inside it returned: used now
        if torch.is_grad_enabled():                    # backward will need the parameters again
            for t in outputs:                          # (not a returned parameter: its hook would
                if torch.is_tensor(t) and t.requires_grad and t.grad_fn is not None:   # stay)
                    t.register_hook(lambda grad: unit.pre_backward())

    def _keep_returned(self, outputs) -> list[Unit]:
        """[Note: returned parameters] A module may return a parameter itself (a bias the caller
        adds, DeepSpeed's test_zero_context_return): its unit stays gathered until the unit around
        the caller finishes its forward, since the caller reads it after the module's post-forward
        (freed, it would read NaN: [Note: absent parameters]). Returns the units kept now."""
        owners = {id(self._unit_of_param[id(t)]): self._unit_of_param[id(t)] for t in outputs
                  if isinstance(t, nn.Parameter) and id(t) in self._unit_of_param}
        if not owners:
            return []
        for waiting in self._returned.values():        # handed on outwards, not freed twice
            waiting[:] = [u for u in waiting if id(u) not in owners]
        # no unit around the caller: the model's forward is, and its end frees them
        around = self._in_forward[-1] if self._in_forward else self.module
        self._returned.setdefault(id(around), []).extend(owners.values())
        return list(owners.values())

    def _free_returned(self, around: int, kept: list[Unit]) -> None:
        for unit in self._returned.pop(around, []):
            if unit not in kept and not unit.held and unit.training_state != PRE_BACKWARD:
                unit.free()

    def _on_model_forward_end(self, module, args, output) -> None:
        self._in_forward.clear()
        self._free_returned(id(self.module), [])

    def prefetch_after(self, unit: Unit, forward: bool) -> None:
        """Start gathering the unit after `unit` (in forward's order, or backward's), so that its
        all-gather runs while `unit` computes."""
        order = self.forward_order if forward else self.backward_order
        following = order.index(unit) + 1
        if self.prefetch and following < len(order):
            order[following].gather(prefetch=True, forward=forward)

    def backward(self, loss: torch.Tensor) -> None:
        for unit in self.units:                        # a forward from here on is a recompute
            unit.training_state = PRE_BACKWARD         # [Note: recompute]
        super().backward(loss)

    def _bucket_ready(self, b):
        return self._unit_of_bucket[b.index].post_backward()   # the reducer: in bucket order

    def free_finished(self) -> None:
        """Free the units whose backward is done but whose frozen parameters were kept."""
        for unit in self.finished:
            unit.free()
        self.finished.clear()

    def _after_backward(self) -> None:
        super()._after_backward()                      # post_backward of units that got no gradient
        self.finished.clear()
        for unit in self.units:                        # and units a prefetch gathered after it
            unit.free()
            unit.training_state = IDLE
            unit.drop_secondary()                      # hpZ: units with nothing to train keep it

    def _after_step(self) -> None:
        pass                                           # the optimizer updated the shards in place

    # --- engine.gathered(): the units holding the parameters asked for ----------------------------
    def _units_of(self, params) -> list[Unit]:
        wanted = {id(p) for p in params}
        return [u for u in self.units if any(id(p) in wanted for p in u.params)]

    def _gather_for_user(self, params) -> None:
        # units not held yet: a nested gathered() (full_state_dict inside one) keeps the outer's
        newly = [unit for unit in self._units_of(params) if not unit.held]
        for unit in newly:
            unit.gather()
            unit.held = True
        self._gathered_for_user.append(newly)

    def _after_user_write(self, params) -> None:
        for unit in self._units_of(params):            # the full parameters were written: my part
            for full, shard in unit.buffers():
                shard.copy_(partition(full, self.layout.rank, self.layout.world_size))
        super()._after_user_write(params)              # the masters follow the shards

    def _write_marks(self, params) -> tuple[torch.Tensor, list[int]]:
        """What shows a write to the gathered parameters: a checksum of each full buffer (its
        elements' bits, summed as integers: exact, and changed by any one element written) and
        where each parameter's values live (`p.data = ...` moves them)."""
        sums = [full.view(_SAME_SIZE_INT[full.element_size()]).sum(dtype=torch.int64)
                for unit in self._units_of(params) for full, _ in unit.buffers()]
        return torch.stack(sums) if sums else torch.zeros(0), [p.data_ptr() for p in params]

    def _refuse_dropped_writes(self, params, marks) -> None:
        """gathered(modifier_rank=None) at its end: if any rank wrote, every rank raises (one
        all-reduce of a flag per rank, so that no rank goes on alone and all name the writers)."""
        sums, places = self._write_marks(params)
        wrote = torch.zeros(self.world_size, device=self.device)
        wrote[comm.rank()] = float(places != marks[1] or not torch.equal(sums, marks[0]))
        comm.all_reduce(wrote, op="sum", tag="gathered(modifier_rank=None): a write?")
        writers = [r for r, w in enumerate(wrote.tolist()) if w]
        if writers:
            raise ParameterWriteError(
                f"rank{'s' if len(writers) > 1 else ''} {', '.join(map(str, writers))} wrote to "
                "stage-3 parameters inside engine.gathered(modifier_rank=None), where a write "
                "cannot take effect (each rank keeps its partition from before the block): use "
                "engine.gathered(modifier_rank=r), and rank r's values reach every rank")

    def _release_for_user(self, params) -> None:
        for unit in self._gathered_for_user.pop():
            unit.held = False
            unit.free()

    def _param_tensors(self):
        return [full for unit in self.units for full, _ in unit.buffers()]    # 0 bytes while free

    def _extra_tensors(self, category):
        shard_category = "offloaded" if self.offload == "params" else "params"
        extra = super()._extra_tensors(category)
        if category == shard_category:
            extra = extra + [self.param_shard] + [u.frozen_shard for u in self.units]
        if category == "params":                       # hpZ's secondaries live on the device
            extra = extra + [t for u in self.units for t in (u.secondary or [])]
        return extra
