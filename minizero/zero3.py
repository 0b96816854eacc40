"""ZeRO stage 3, P_os+g+p: stage 2, plus each rank stores only its partition of the parameters.

    python -m minizero.run --stage 3 --world-size 4 [--offload | --offload params]
    engine = minizero.wrap(model, 3, functools.partial(torch.optim.AdamW, lr=1e-3))

What each rank holds (paper, section 5.3): (2 + 2 + K)Ψ/N bytes (16Ψ -> 0.25Ψ for Adam, N = 64),
plus the few *units* gathered at any moment. Per step: all-gather Ψ (forward) + all-gather Ψ
(backward) + reduce-scatter Ψ = 3Ψ, 1.5x DDP: the price of not replicating parameters.

Read zero2.py first. Stage 3 is stage 2's row of the table (stages.py) with the parameters family
changed, P_p: what happens to a unit (Unit), then the family that builds the units and drives them
from the model's hooks (ShardedUnits). Which modules are units: units.py.
  * A unit's parameters are one bucket (flat.py); rank r keeps its partition of every unit in
    `shard` [Ψ/N]. Frozen parameters (Ψ_f: LoRA's base) are partitioned alike, never reduced.
  * Forward: pre-forward all-gathers the unit (and prefetches the next), post-forward frees it.
  * Backward: a hook on its outputs gathers it again; when its gradients are complete,
    post-backward reduce-scatters them as stage 2 does (the unit is the bucket), and frees it.
Variants are routes (comm.Route, ShardedUnits.__init__): offload="params" (the shard on the host),
quantized_weights (ZeRO++ qwZ), shard_group_size ([Note: hierarchical sharding] in engine.py).
[Note: hpZ] ZeRO++'s hpz_group_size=R: the forward all-gather also leaves each rank its 1/R of the
unit within its node (`secondary`), so backward's all-gather stays there: 3Ψ -> 2Ψ across nodes.
[Note: recompute] Activation checkpointing reruns a unit's forward in backward, which must neither
free it nor prefetch: engine.backward() puts every unit in PRE_BACKWARD, where a forward recomputes.
"""

from __future__ import annotations

from enum import Enum
from functools import partial
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten

from minizero import comm, construct, events
from minizero.absent import HeldForUser, absent_like, refuse_writes
from minizero.flat import Bucket, FlatLayout, partition
from minizero.options import StageOptions
from minizero.units import (ReturnedParameters, UnitCallbacks, UnitRoutes, assign_units,
                            default_units)


class ShardState(Enum):
    """What the unit's full buffer holds."""
    FREE = "free"              # 0 bytes, shape kept; the parameters are absent (absent.py)
    IN_FLIGHT = "in flight"    # allocated, its all-gather started (a prefetch), not waited for
    GATHERED = "gathered"      # the whole unit; the module's parameters are views of it


class TrainingState(Enum):
    """Where the step is, for this unit (FSDP2's TrainingState)."""
    IDLE = "idle"                  # no hook of it runs: before or after its backward
    FORWARD = "forward"            # pre_forward ran, post_forward not yet
    PRE_BACKWARD = "pre-backward"  # backward started, this unit's not done ([Note: recompute])


class Unit:
    """One unit: its module, its buffers, its states, and what each hook does to it. Only its own
    methods change its states (tests/test_architecture.py checks), as in FSDP2's FSDPParamGroup.

    full [Ψ_u padded]  its trainable parameters end to end: 0 bytes while FREE (shape kept),
                       allocated while IN_FLIGHT / GATHERED, when the parameters are views of it.
    shard [Ψ_u / N]    this rank's partition, a view into ShardedUnits.shard: all that persists.
    frozen_full, frozen_shard: the same for its frozen parameters; secondary: hpZ's [Ψ_u / R].
    training_state     IDLE -pre_forward-> FORWARD -post_forward-> IDLE; enter_backward() ->
                       PRE_BACKWARD -post_backward-> IDLE. owner: the engine, named in its events.
    """

    def __init__(self, owner, module, name: str, index: int, routes: UnitRoutes, bucket,
                 buffers: list[tuple[torch.Tensor, torch.Tensor]], frozen_bucket,
                 callbacks: UnitCallbacks):
        self.owner, self.module, self.name, self.index = owner, module, name, index
        self.routes, self.bucket, self.frozen_bucket, self.callbacks = (routes, bucket,
                                                                        frozen_bucket, callbacks)
        self.tag = f"unit {index} ({name})"           # what its collectives are for (event stream)
        (self.full, self.shard), (self.frozen_full, self.frozen_shard) = buffers
        self.params = [p for b in (bucket, frozen_bucket) if b is not None for p in b.params]
        # each parameter while GATHERED (a view of full: flat.py) and while not (absent.py)
        self.views = [p.data for p in self.params]
        self.absent = [absent_like(p) for p in self.params]
        self.state, self.training_state = ShardState.GATHERED, TrainingState.IDLE
        self.held_for_user = False         # engine.gathered() holds it: forward does not free it
        self.secondary: list[torch.Tensor] | None = None
        self._in_flight: list = []                     # all-gather handles while IN_FLIGHT
        self.free()                                    # built gathered; released right away

    def buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(full, shard) for its trainable and its frozen parameters, those it has."""
        pairs = (self.full, self.shard), (self.frozen_full, self.frozen_shard)
        return [(full, shard) for full, shard in pairs if full.numel()]

    def full_bytes(self) -> int:
        """The bytes its full buffers hold now: 0 while FREE."""
        return sum(full.untyped_storage().nbytes() for full, _ in self.buffers())

    # --- its buffer: FREE -> IN_FLIGHT -> GATHERED -> FREE ----------------------------------------
    def gather(self, prefetch: bool = False, forward: bool = False) -> None:
        """FREE -> IN_FLIGHT -> GATHERED: all-gather `full` from the shards (prefetch: start)."""
        if self.state == ShardState.GATHERED or (self.state == ShardState.IN_FLIGHT and prefetch):
            return
        if self.state == ShardState.FREE:
            route, sources = self._route(forward)
            for (full, _), source in zip(self.buffers(), sources):
                full.untyped_storage().resize_(full.numel() * full.element_size())   # allocate
                # <- the essential line of stage 3: every rank's partition -> the full unit
                self._in_flight.append(route.all_gather(full, source, self.tag))
            self.state = ShardState.IN_FLIGHT
            events.emit("unit gather", engine=self.owner, unit=self, prefetch=prefetch,
                        nbytes=self.full_bytes())
            if prefetch:
                return
        self._wait()
        self.state = ShardState.GATHERED
        self.point_params(gathered=True)
        if self.routes.node is not None and self.training_state == TrainingState.FORWARD:
            self._keep_secondary()
        events.emit("unit gathered", engine=self.owner, unit=self)

    def _route(self, forward: bool) -> tuple[comm.Route, list[torch.Tensor]]:
        """Backward's all-gather runs within the node from the secondaries when hpZ kept them."""
        if self.training_state == TrainingState.PRE_BACKWARD and self.secondary is not None:
            return self.routes.node, self.secondary
        route = self.routes.forward if forward else self.routes.exact
        return route, [shard for _, shard in self.buffers()]

    def _wait(self) -> None:
        for handle in self._in_flight:
            handle.wait()
        self._in_flight = []

    def point_params(self, gathered: bool) -> None:
        """The parameters: views of `full` while gathered, absent otherwise (absent.py)."""
        for p, view, absent in zip(self.params, self.views, self.absent):
            p.data = view if gathered else absent
            refuse_writes(p, not gathered)

    def free(self) -> None:
        """Release `full` (0 bytes); the parameters become absent (absent.py)."""
        if self.state == ShardState.FREE:
            return
        self._wait()                                   # never free a buffer a collective is writing
        nbytes = self.full_bytes()
        self.point_params(gathered=False)
        for full, _ in self.buffers():
            full.untyped_storage().resize_(0)
        self.state = ShardState.FREE
        events.emit("unit freed", engine=self.owner, unit=self, nbytes=-nbytes)

    def _keep_secondary(self) -> None:
        """[Note: hpZ]: keep this rank's 1/R of the full unit, its slice within the node's group."""
        group = self.routes.node.group
        self.drop_secondary()
        self.secondary = [partition(full, comm.group_rank(group), comm.group_size(group)).clone()
                          for full, _ in self.buffers()]
        events.emit("secondary", engine=self.owner, unit=self,
                    nbytes=sum(t.nbytes for t in self.secondary))

    def drop_secondary(self) -> None:
        if self.secondary is not None:
            events.emit("secondary", engine=self.owner, unit=self,
                        nbytes=-sum(t.nbytes for t in self.secondary))
        self.secondary = None

    # --- the four hooks: ShardedUnits calls them from the module's forward hooks and autograd -----
    def pre_forward(self) -> None:
        if self.training_state == TrainingState.PRE_BACKWARD:   # a recompute [Note: recompute]
            self.gather()                              # reentrant: its first use in this backward
            return
        self.training_state = TrainingState.FORWARD
        self.gather(forward=True)
        self._prefetch(forward=True)

    def post_forward(self, keep: bool = False) -> None:
        """keep: a parameter of it was returned ([Note: returned parameters] in units.py)."""
        if self.training_state == TrainingState.PRE_BACKWARD:   # a recompute: its backward needs
            return                                               # the parameters
        self.training_state = TrainingState.IDLE
        if not (keep or self.held_for_user
                or (torch.is_grad_enabled() and self.callbacks.keep_gathered(self))):
            self.free()                                # <- stage 3's saving: free after forward

    def pre_backward(self) -> None:
        """Its output's gradient is known: its backward is next, every later unit's is done."""
        self.callbacks.free_finished()
        self.training_state = TrainingState.PRE_BACKWARD
        self.gather()
        self._prefetch(forward=False)

    def post_backward(self, reduce_scatter: Callable):
        """Its gradients are complete: reduce_scatter them (GradientShard.reduce), free it; the
        handle. Frozen parameters may still be needed (the input's gradient can flow through a
        frozen weight after the last trainable gradient, as LoRA's does): then it is freed later."""
        handle = reduce_scatter(self.bucket, self.tag)
        self.training_state = TrainingState.IDLE
        self.drop_secondary()                          # hpZ: its backward all-gather is done
        if self.frozen_bucket is None:
            self.free()
        else:
            self.callbacks.backward_done(self)          # freed by the next pre_backward, or the end
        return handle

    def _prefetch(self, forward: bool) -> None:
        """Start gathering the next unit, so that its all-gather runs while this one computes."""
        following = self.callbacks.following(self, forward)
        if following is not None:
            following.gather(prefetch=True, forward=forward)

    # --- what the engine's backward and gathered() do to every unit ------------------------------
    def enter_backward(self) -> None:
        """engine.backward() starts (FSDP: the first gradient): [Note: recompute]."""
        self.training_state = TrainingState.PRE_BACKWARD

    def end_backward(self) -> None:
        """Backward is done: free it (prefetched after its last use, or frozen parameters kept)."""
        self.free()
        self.training_state = TrainingState.IDLE
        self.drop_secondary()

    def release_returned(self) -> None:
        """The caller that read a parameter it returned is done: free it, unless still in use."""
        if not self.held_for_user and self.training_state != TrainingState.PRE_BACKWARD:
            self.free()

    def hold_for_user(self) -> None:
        """engine.gathered(): gathered until release_for_user(), through any forward."""
        self.gather()
        self.held_for_user = True

    def release_for_user(self) -> None:
        self.held_for_user = False
        self.free()


class ShardedUnits:
    """P_p: the parameters family of stage 3 (stages 0-2: ddp.ReplicatedParameters): the units,
    their shards, and each unit's hooks called from the model's hooks and autograd."""
    unit_class = Unit       # what units are made of: exercise 7's grader brings the learner's hooks

    def __init__(self, engine, groups: None, options: StageOptions):
        model, units = engine.module, options.units               # groups: none, units decide
        chosen = default_units(model) if units is None else units
        modules, trains, frozen = assign_units(model, chosen, chosen=units is not None)
        # one bucket per unit that trains: [Note: hierarchical sharding] in engine.py for the N
        self.layout = FlatLayout.build([group for group in trains if group],
                                       comm.group_size(engine.shard_group),
                                       comm.group_rank(engine.shard_group))
        self.host = engine.offload == "params"         # ZeRO-Infinity style: the shard on the host
        home = torch.device("cpu") if self.host else engine.device
        pin = self.host and engine.device.type == "cuda"   # pinned: host -> device copies run async
        self.shard = torch.empty(self.layout.shard_numel, dtype=engine.dtype, device=home,
                                 pin_memory=pin)                                        # [Ψ/N]
        # the variants are routes, not branches ([Note: hierarchical sharding], [Note: hpZ])
        exact = comm.Route(engine.shard_group, home="host" if self.host else "device")
        forward = comm.Route(exact.group, engine.int8_codec(options.quantization_block),
                             exact.home) if options.quantized_weights else exact
        node = None if engine.hpz_group is None else comm.Route(engine.hpz_group)
        self.model, self.prefetch = model, options.prefetch
        self.forward_order: list[Unit] = []     # pre-forward order, recorded on the first step
        self.backward_order: list[Unit] = []    # reverse post-forward order: backward's order
        self._finished: list[Unit] = []         # backward done, frozen parameters still gathered
        callbacks = UnitCallbacks(self.following, self._finished.append, self.free_finished,
                                  engine.keeps_gathered)
        names = {id(m): name or "<root>" for name, m in model.named_modules()}
        buckets, self.units = iter(self.layout.buckets), []
        for i, (module, trainable, frozen_params) in enumerate(zip(modules, trains, frozen)):
            bucket = next(buckets) if trainable else None
            frozen_bucket = FlatLayout.build([frozen_params], self.layout.world_size,
                                             self.layout.rank).buckets[0] if frozen_params else None
            shard = self.layout.shard(self.shard, bucket) if bucket else None
            frozen_shard = torch.empty(frozen_bucket.shard_numel, dtype=engine.dtype, device=home,
                                       pin_memory=pin) if frozen_bucket else None  # [Ψ_f,u / N]
            buffers = [self.layout.unit_buffers(b, s, engine.dtype, engine.device,
                                                construct.take_value)   # sharded_init's values
                       for b, s in ((bucket, shard), (frozen_bucket, frozen_shard))]
            self.units.append(self.unit_class(engine, module, names[id(module)], i,
                                              UnitRoutes(forward, exact, node), bucket, buffers,
                                              frozen_bucket, callbacks))
        self._unit_of_bucket = {u.bucket.index: u for u in self.units if u.bucket is not None}
        self.returned = ReturnedParameters(model, {id(p): u for u in self.units for p in u.params})
        self.for_user = HeldForUser(self.units, self.layout)       # engine.gathered() (absent.py)
        self.hooks = []                      # their handles: fairscale/fsdp.py hands a model over
        for unit in self.units:
            self.hooks += [
                unit.module.register_forward_pre_hook(partial(self._on_pre_forward, unit)),
                unit.module.register_forward_hook(partial(self._on_post_forward, unit))]
        self.hooks.append(model.register_forward_hook(self._on_model_forward_end))

    # --- what the optimizer steps: each unit's shard, updated in place ---------------------------
    def optimizer_parts(self) -> list[torch.Tensor]:
        return [self._unit_of_bucket[b.index].shard for b in self.layout.buckets]

    def after_step(self) -> None:                      # the next forward gathers what it needs
        pass

    # --- forward: the model's hooks drive each unit's lifecycle ----------------------------------
    def _on_pre_forward(self, unit: Unit, module, args) -> None:
        if unit not in self.forward_order:
            self.forward_order.append(unit)
        self.returned.enter(unit)
        unit.pre_forward()

    def _on_post_forward(self, unit: Unit, module, args, output) -> None:
        if unit not in self.backward_order:
            self.backward_order.insert(0, unit)
        outputs = tree_flatten(output)[0]              # tensors in tuples, dicts, ModelOutputs
        kept = self.returned.keep(unit, outputs)       # [Note: returned parameters] in units.py
        unit.post_forward(keep=unit in kept)
        self.returned.release(unit, kept)              # what units inside it returned: used now
        if torch.is_grad_enabled():                    # backward will need the parameters again
            for t in outputs:                          # (not a returned parameter: its hook would
                if torch.is_tensor(t) and t.requires_grad and t.grad_fn is not None:   # stay)
                    t.register_hook(lambda grad: unit.pre_backward())

    def _on_model_forward_end(self, module, args, output) -> None:
        self.returned.release(self.model, [])

    def following(self, unit: Unit, forward: bool) -> Unit | None:
        """The unit after `unit` in forward's (or backward's) order, as the first step ran."""
        order = self.forward_order if forward else self.backward_order
        at = order.index(unit) + 1
        return order[at] if self.prefetch and at < len(order) else None

    # --- backward: autograd drives it, the reducer hands each complete bucket here ----------------
    def before_backward(self) -> None:
        for unit in self.units:                        # a forward from here on is a recompute
            unit.enter_backward()                      # [Note: recompute]

    def bucket_ready(self, b: Bucket, reduce_scatter):
        return self._unit_of_bucket[b.index].post_backward(reduce_scatter)   # in bucket order

    def free_finished(self) -> None:                   # backward done, frozen parameters kept
        for unit in self._finished:
            unit.free()
        self._finished.clear()

    def after_backward(self) -> None:
        self._finished.clear()
        for unit in self.units:            # and units a prefetch gathered after their last use
            unit.end_backward()

    # --- memory -----------------------------------------------------------------------------------
    def param_tensors(self) -> list[torch.Tensor]:
        return [full for unit in self.units for full, _ in unit.buffers()]    # 0 bytes while free

    def tensors(self, category: str) -> list[torch.Tensor]:
        """The shards (on the host with offload="params") and hpZ's secondaries (the device)."""
        shards = [self.shard] + [u.frozen_shard for u in self.units]
        secondaries = [t for u in self.units for t in (u.secondary or [])]
        return ((shards if category == ("offloaded" if self.host else "params") else [])
                + (secondaries if category == "params" else []))
