"""ZeRO stage 3, P_os+g+p: stage 2, plus each rank stores only its partition of the parameters.

    python -m minizero.run --stage 3 --world-size 4 [--offload | --offload params]
    engine = minizero.wrap(model, 3, functools.partial(torch.optim.AdamW, lr=1e-3))

What each rank holds (paper, section 5.3): (2 + 2 + K)Ψ/N bytes (16Ψ -> 0.25Ψ for Adam, N = 64),
plus the few *units* gathered at any moment. Per step: all-gather Ψ (forward) + all-gather Ψ
(backward) + reduce-scatter Ψ = 3Ψ, 1.5x DDP: the price of not replicating parameters.

Read zero2.py first: stage 3 is stage 2's row of the table with the parameters family changed (P_p):
what happens to a unit (Unit), and the family that drives the units from the model's hooks.
  * A unit is a module (a transformer block; the model itself, unit 0, holds the rest). Its
    parameters are one bucket (flat.py); rank r keeps its partition of every unit in `shard` [Ψ/N].
    Units are numbered in forward order; their buckets lie in backward's (the reducer's) order.
  * Forward: pre-forward all-gathers the unit (and prefetches the next), post-forward frees it.
  * Backward: a hook on its outputs gathers it again; when its gradients are complete,
    post-backward reduce-scatters them as stage 2 does (the unit is the bucket), and frees it.
  * Frozen parameters (LoRA's base) are partitioned alike in a second buffer, never reduced.
    offload="params" keeps the shard in host memory, copied to the device before each all-gather.
units.py is what wrap's engines plug into a unit (default units, engine.gathered(), ...).
"""

from __future__ import annotations

import functools
import math
from enum import Enum

import torch
from torch.utils._pytree import tree_flatten

from minizero import comm, events
from minizero.flat import Bucket, FlatLayout, partition


class ShardState(Enum):
    """What the unit's full buffer holds."""
    FREE = "free"              # 0 bytes, shape kept; the parameters are absent (read NaN)
    IN_FLIGHT = "in flight"    # allocated, its all-gather started (a prefetch), not waited for
    GATHERED = "gathered"      # the whole unit; the module's parameters are views of it


class TrainingState(Enum):
    """Where the step is, for this unit (FSDP2's TrainingState)."""
    IDLE = "idle"                  # no hook of it runs: before or after its backward
    FORWARD = "forward"            # pre_forward ran, post_forward not yet
    PRE_BACKWARD = "pre-backward"  # its output's gradient arrived, its gradients not yet complete


class Unit:
    """One unit: its module, its buffers, its states, and what each hook does to it. Only its own
    methods change its states (tests/test_architecture.py checks), as in FSDP2's FSDPParamGroup.
    full [Ψ_u padded]: its trainable parameters end to end, 0 bytes while FREE; the parameters are
    views of it while GATHERED. shard [Ψ_u / N]: this rank's partition, all that persists.
    frozen_full, frozen_shard: the same for its frozen parameters (empty if it has none)."""
    route = comm        # whose all_gather gathers it: comm's (units.py picks others, beyond/'s)

    def __init__(self, family: ShardedUnits, module, name: str, index: int, bucket: Bucket | None,
                 frozen_bucket: Bucket | None):
        self.family, self.owner, self.module = family, family.engine, module
        self.name, self.index, self.tag = name, index, f"unit {index} ({name})"
        self.bucket, self.frozen_bucket = bucket, frozen_bucket
        self.full, self.shard = family.buffers(bucket, family.shard)
        self.frozen_full, self.frozen_shard = family.buffers(frozen_bucket)
        self.params = [p for b in (bucket, frozen_bucket) if b is not None for p in b.params]
        self.views = [p.data for p in self.params]           # each parameter while GATHERED
        # ... and while not: its shape, NaN everywhere ([Note: absent parameters] in absent.py)
        self.absent = [p.new_full((1,), math.nan).expand(p.shape) for p in self.params]
        self.state, self.training_state = ShardState.GATHERED, TrainingState.IDLE
        self._in_flight: list = []                     # (handle, its input) while IN_FLIGHT
        self.free()                                    # built gathered; released right away

    def buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:     # (full, shard): those it has
        pairs = (self.full, self.shard), (self.frozen_full, self.frozen_shard)
        return [(full, shard) for full, shard in pairs if full.numel()]

    def full_bytes(self) -> int:
        return sum(full.untyped_storage().nbytes() for full, _ in self.buffers())   # 0 if FREE

    # --- its buffer: FREE -> IN_FLIGHT -> GATHERED -> FREE ----------------------------------------
    def gather(self, prefetch: bool = False, forward: bool = False) -> None:
        """FREE -> IN_FLIGHT -> GATHERED: all-gather `full` from the shards (prefetch: start it;
        forward: for a forward, units.py's route for those may differ)."""
        if self.state == ShardState.GATHERED or (self.state == ShardState.IN_FLIGHT and prefetch):
            return
        if self.state == ShardState.FREE:
            for full, shard in self.buffers():
                full.untyped_storage().resize_(full.numel() * full.element_size())   # allocate
                source = shard.to(full.device, non_blocking=True)    # offload="params": a copy
                # <- the essential line of stage 3: every rank's partition -> the full unit
                handle = self.route_for(forward).all_gather(
                    full, source, async_op=True, group=self.family.group, tag=self.tag)
                self._in_flight.append((handle, source))   # the copy lives until it is sent
            self.state = ShardState.IN_FLIGHT
            events.emit("unit gather", engine=self.owner, unit=self, prefetch=prefetch,
                        nbytes=self.full_bytes())
            if prefetch:
                return
        self._wait()
        self.state = ShardState.GATHERED
        self.point_params(gathered=True)
        events.emit("unit gathered", engine=self.owner, unit=self)

    def route_for(self, forward: bool):
        return self.route               # comm, for a forward or not: the paper's

    def _wait(self) -> None:
        for handle, _ in self._in_flight:
            handle.wait()
        self._in_flight = []

    def point_params(self, gathered: bool) -> None:     # views of `full`, or absent
        for p, view, absent in zip(self.params, self.views, self.absent):
            p.data = view if gathered else absent

    def free(self) -> None:                             # release `full`: 0 bytes
        if self.state == ShardState.FREE:
            return
        self._wait()                                   # never free what a collective writes into
        nbytes = self.full_bytes()
        self.point_params(gathered=False)
        for full, _ in self.buffers():
            full.untyped_storage().resize_(0)
        self.state = ShardState.FREE
        events.emit("unit freed", engine=self.owner, unit=self, nbytes=-nbytes)

    # --- the four hooks: ShardedUnits calls them from the module's forward hooks and autograd -----
    def pre_forward(self) -> None:
        self.training_state = TrainingState.FORWARD
        self.gather(forward=True)
        self._prefetch(forward=True)

    def post_forward(self) -> None:
        self.training_state = TrainingState.IDLE
        if not self.stays_gathered():
            self.free()                                # <- stage 3's saving: free after forward

    def stays_gathered(self) -> bool:
        return False                    # never, in the paper (units.py's units may stay)

    def pre_backward(self) -> None:
        """Its output's gradient is known: its backward is next, every later unit's is done."""
        self.family.free_finished()
        self.training_state = TrainingState.PRE_BACKWARD
        self.gather()
        self._prefetch(forward=False)

    def post_backward(self, reduce_scatter):
        """Its gradients are complete: reduce_scatter them (GradientShard.reduce), free it; the
        handle. Frozen parameters may still be needed (the input's gradient can flow through a
        frozen weight after the last trainable gradient, as LoRA's does): then it is freed later."""
        handle = reduce_scatter(self.bucket, self.tag)
        self.training_state = TrainingState.IDLE
        if self.frozen_bucket is None:
            self.free()
        else:
            self.family.finished.append(self)     # freed by the next pre_backward, or the end
        return handle

    def _prefetch(self, forward: bool) -> None:         # the next one gathers while this computes
        following = self.family.following(self, forward)
        if following is not None:
            following.gather(prefetch=True, forward=forward)

    def end_backward(self) -> None:      # free what a prefetch gathered late, or frozen kept
        self.free()
        self.training_state = TrainingState.IDLE


class ShardedUnits:
    """P_p at stage 3 (stages 0-2: ddp.ReplicatedParameters): the units, their shards, and each
    unit's hooks called from the model's hooks and autograd."""
    unit_class = Unit       # what units are made of (units.py's; exercise 7's: the learner's)
    value_of = staticmethod(torch.Tensor.detach)   # a parameter's value (units.py: sharded_init's)

    def __init__(self, engine, buckets: None, options):
        self.engine, self.group, self.prefetch = engine, engine.group, options.prefetch
        model = engine.module
        modules, owned = zip(*(options.units or [(model, list(model.parameters()))]))
        trains = [[p for p in params if p.requires_grad] for params in owned]
        # one bucket per unit that trains, in backward's order: the model's last
        self.layout = FlatLayout.build([t for t in reversed(trains) if t],
                                       comm.group_size(self.group), comm.group_rank(self.group))
        bucket_of = dict(zip([id(m) for m, t in zip(modules, trains) if t][::-1],
                             self.layout.buckets))
        self.host = engine.offload == "params"            # the shard on the host
        self.shard = self.empty(self.layout.shard_numel)                               # [Ψ/N]
        self.forward_order: list[Unit] = []     # pre-forward order, recorded on the first step
        self.backward_order: list[Unit] = []    # reverse post-forward order: backward's order
        self.finished: list[Unit] = []          # backward done, frozen parameters still gathered
        names = {id(m): name or "<root>" for name, m in model.named_modules()}
        self.units = []
        for module, params in zip(modules, owned):
            frozen = [p for p in params if not p.requires_grad]
            frozen_bucket = FlatLayout.build([frozen], self.layout.world_size,
                                             self.layout.rank).buckets[0] if frozen else None
            self.units.append(self.unit_class(self, module, names[id(module)], len(self.units),
                                              bucket_of.get(id(module)), frozen_bucket))
        self._unit_of_bucket = {u.bucket.index: u for u in self.units if u.bucket is not None}
        self.hooks = []
        for unit in self.units:
            self.hooks += [
                unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit)),
                unit.module.register_forward_hook(functools.partial(self._post_forward, unit))]

    def empty(self, numel: int) -> torch.Tensor:        # a shard buffer (pinned: async copies)
        home = torch.device("cpu") if self.host else self.engine.device
        return torch.empty(numel, dtype=self.engine.dtype, device=home,
                           pin_memory=self.host and self.engine.device.type == "cuda")

    def buffers(self, b: Bucket | None, shard: torch.Tensor | None = None):
        """A unit's full [padded_numel] (the parameters made views of it) and shard [shard_numel]
        for bucket b (empty ones for none)."""
        if b is None:
            return (torch.empty(0, dtype=self.engine.dtype, device=self.engine.device),) * 2
        full = FlatLayout.flatten_bucket(b, self.engine.dtype, self.engine.device, self.value_of)
        shard = self.empty(b.shard_numel) if shard is None else FlatLayout.shard(shard, b)
        return full, shard.copy_(partition(full, self.layout.rank, b.world_size))

    def optimizer_parts(self) -> list[torch.Tensor]:    # each unit's shard, stepped in place
        return [self._unit_of_bucket[b.index].shard for b in self.layout.buckets]

    def after_step(self) -> None:                      # the next forward gathers what it needs
        pass

    # --- forward: the model's hooks drive each unit's lifecycle ----------------------------------
    def _pre_forward(self, unit: Unit, module, args) -> None:
        if unit not in self.forward_order:
            self.forward_order.append(unit)
        unit.pre_forward()

    def _post_forward(self, unit: Unit, module, args, output) -> None:
        if unit not in self.backward_order:
            self.backward_order.insert(0, unit)
        unit.post_forward()
        if torch.is_grad_enabled():                    # backward needs it again: pre_backward
            for t in tree_flatten(output)[0]:          # tensors in tuples, dicts, ModelOutputs
                if torch.is_tensor(t) and t.requires_grad and t.grad_fn is not None:
                    t.register_hook(lambda grad: unit.pre_backward())

    def following(self, unit: Unit, forward: bool) -> Unit | None:
        """The unit after `unit` in forward's (or backward's) order, as the first step ran it."""
        order = self.forward_order if forward else self.backward_order
        at = order.index(unit) + 1
        return order[at] if self.prefetch and at < len(order) else None

    # --- backward: autograd drives it, the reducer hands each complete bucket here ----------------
    def before_backward(self) -> None:                 # units.py's recompute starts here
        pass

    def bucket_ready(self, b: Bucket, reduce_scatter):
        return self._unit_of_bucket[b.index].post_backward(reduce_scatter)   # in bucket order

    def free_finished(self) -> None:                   # backward done, frozen parameters kept
        for unit in self.finished:
            unit.free()
        self.finished.clear()

    def after_backward(self) -> None:
        self.finished.clear()
        for unit in self.units:            # and units a prefetch gathered after their last use
            unit.end_backward()

    def param_tensors(self) -> list[torch.Tensor]:
        return [full for unit in self.units for full, _ in unit.buffers()]    # 0 bytes while free

    def tensors(self, category: str) -> list[torch.Tensor]:   # the shards (offload="params": host)
        shards = [self.shard] + [u.frozen_shard for u in self.units]
        return shards if category == ("offloaded" if self.host else "params") else []
