"""What happens to a `fully_shard` unit: FSDP2's per-parameter design, beside zero3.py's flat one.

    python -m pytest tests/test_fully_shard.py tests/test_fully_shard_scenarios.py

One fully_shard(module) call (or fully_shard([a, b])) makes one Unit: the module's parameters that
no unit below it holds, each a ShardedParam ([Note: dim-0 shards] in fsdp_param.py). Its life is
zero3.Unit's, with the same states (ShardState: FREE / IN_FLIGHT / GATHERED) and the same events on
the stream ("unit gather", "unit gathered", "unit freed", "secondary", "bucket ready", "staging",
"bucket arrived"):
  * pre_forward: all-gather the unit (GATHERED: the module's parameters are whole), start the
    next unit's all-gather (prefetch);
  * post_forward: free it (reshard_after_forward=True), keep 1/k of it (=k) or all of it (False);
    hook its outputs;
  * pre_backward (a hook on its outputs: their gradient is known, its backward is next): gather it
    again, start the all-gather of the unit that ran before it;
  * post_backward (an autograd node on its inputs, [Note: post-backward] in fsdp_reduce.py):
    reduce-scatter its gradients (fsdp_reduce.py) and free it. A reduce-scatter is finished
    (waited, this rank's rows added to the shards' .grad) when the next one starts or backward
    ends: one in flight, overlapping the backward of the units before it.
What the per-parameter layout costs against zero3.Unit's flat buckets: a copy on each side of
each collective. The all-gather moves every parameter's padded shard side by side, a [N, Σ
chunk·row] buffer whose row r is rank r's shards, then copies each parameter's column out into
its own whole tensor; the reduce-scatter is its mirror. The flat layout needs neither (its
parameters are views of the gathered bucket); in exchange each parameter stays a tensor of its own
shape, so its shard is a DTensor that the optimizer, clip_grad_norm_ and checkpoints use as it is.
"""

from __future__ import annotations

from enum import Enum

import torch
from torch.utils._pytree import tree_flatten, tree_map

from minizero import comm, events
from minizero.pytorch.fsdp_reduce import PostBackward, Reduction
from minizero.zero3 import ShardState     # FREE: the module holds its shards (DTensors)


class TrainingState(Enum):
    """Where the step is, for this unit (FSDP2's)."""
    IDLE = "idle"
    FORWARD = "forward"                # pre_forward ran, post_forward not yet
    PRE_BACKWARD = "pre-backward"      # its backward is under way (a forward now is a recompute)
    POST_BACKWARD = "post-backward"    # its gradients are on their way to the shards


class Unit:
    """One fully_shard call: its module, its parameters' shards, its states, and what each hook
    does to them. Only its own methods change its states (tests/test_architecture.py).

    params          the ShardedParams (each: padded shard, DTensor, whole parameter, gradient)
    groups          fsdp_mesh.MeshGroups: shard, replicate (HSDP), post_forward (=k)
    after_forward   True, False or k: what post_forward keeps (FSDP2's reshard_after_forward)
    reduce_grads, all_reduce_grads, reshard_after_backward: set by FSDPModule's setters
    root            fsdp_root.Root, shared with every unit under the root, from its first forward
    """

    def __init__(self, modules, params, groups, mp_policy, home: torch.device):
        self.modules, self.params, self.groups, self.mp = tuple(modules), params, groups, mp_policy
        self.module = self.modules[0]
        self.home, self.device = home, comm.device()        # home: where the shards live
        self.after_forward = groups.after_forward           # None: decided by the root's adopt()
        self.reduce_grads = self.all_reduce_grads = self.reshard_after_backward = True
        self.unshard_in_backward, self.reduce_unused = True, False      # FSDPModule's setters
        self.divide_factor: float | None = None             # set_gradient_divide_factor
        self.forward_prefetch = self.backward_prefetch = None   # explicit lists of units
        self.root, self.index = None, -1
        self.tied_apart: list[str] = []      # fully_shard.py: refused at the first forward
        self.name = ", ".join(type(m).__name__ for m in self.modules)
        self._to_run: set[int] = set()       # its modules not run yet in this forward (ids)
        self.post_forward_indices: list[int] = []  # where it ran in root.post_forward_order
        self.state, self.training_state = ShardState.FREE, TrainingState.IDLE
        self.secondary: list[torch.Tensor] | None = None   # =k: its 1/k kept after forward
        self.partial: torch.Tensor | None = None   # HSDP: reduce-scatters summed, not all-reduced
        self._in_flight = None                     # (handle, buffer, sizes) while IN_FLIGHT

    def adopt(self, root, index: int, names: list[str], is_root: bool) -> None:
        """The root's first forward: it names the unit, and decides reshard_after_forward=None
        (False for the root, whose parameters backward needs first; True for the others)."""
        self.root, self.index, self.name = root, index, ", ".join(n or "<root>" for n in names)
        if self.after_forward is None:
            self.after_forward = not is_root

    @property
    def tag(self) -> str:                          # what its collectives are for (event stream)
        return f"unit {self.index} ({self.name})"

    @property
    def owner(self):                               # its events' `engine`: the root module
        return self.root.module if self.root is not None else self.module

    @property
    def dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """(compute, reduce): MixedPrecisionPolicy.dtypes of its parameters' own dtype."""
        return self.mp.dtypes(self.params[0].dtype if self.params else torch.float32)

    def full_bytes(self) -> int:
        """What its whole parameters take while gathered (0 bytes each while FREE)."""
        return sum(sp.full_bytes() for sp in self.params)

    # --- its parameters: FREE -> IN_FLIGHT -> GATHERED -> FREE ------------------------------------
    def gather(self, prefetch: bool = False, backward: bool = False) -> None:
        """FREE -> IN_FLIGHT -> GATHERED: all-gather every parameter whole (prefetch: start it)."""
        if self.state == ShardState.GATHERED or (self.state == ShardState.IN_FLIGHT and prefetch) \
                or not self.params or (backward and not self.unshard_in_backward):
            return                                     # (no parameters of its own: a root)
        if self.state == ShardState.FREE:
            group, secondary = self._route(backward)
            size, mine, compute = comm.group_size(group), comm.group_rank(group), self.dtypes[0]
            sizes = [sp.chunk * sp.row * self.groups.shard_size // size for sp in self.params]
            buffer = torch.empty(size, sum(sizes), dtype=compute, device=self.device)
            for i, (sp, row) in enumerate(zip(self.params, buffer[mine].split(sizes))):
                if secondary is None:                  # [G, Σ n_p], row r: rank r's shards
                    sp.copy_shard_into(row)            # copy-in (CPUOffloadPolicy: from the host)
                else:
                    row.copy_(secondary[i])
                sp.allocate(compute, self.device, self.groups.shard_size)
            # <- the essential line: every rank's shards -> every parameter whole
            with comm.backend_collectives():           # [Note: the collectives users count]
                handle = comm.all_gather(buffer.view(-1), buffer[mine], async_op=True,
                                         group=group, tag=self.tag)
            self._in_flight = (handle, buffer, sizes)
            self.state = ShardState.IN_FLIGHT
            events.emit("unit gather", engine=self.owner, unit=self, prefetch=prefetch,
                        nbytes=self.full_bytes())
            if prefetch:
                return
        self._copy_out()
        self.state = ShardState.GATHERED
        for sp in self.params:
            sp.register(gathered=True)
        self.drop_secondary()
        events.emit("unit gathered", engine=self.owner, unit=self)

    def _route(self, backward: bool) -> tuple[comm.Group | None, list[torch.Tensor] | None]:
        """Over which ranks, from what: each parameter's padded shard over the shard group (None);
        in backward, after reshard_after_forward=k, the 1/k that k ranks kept of each."""
        if backward and self.secondary is not None:
            return self.groups.post_forward, self.secondary
        return self.groups.shard, None

    def _copy_out(self) -> None:
        """Wait for the all-gather, then copy each parameter's column [G, n_p] into its whole."""
        handle, buffer, sizes = self._in_flight
        handle.wait()
        self._in_flight = None
        for sp, column in zip(self.params, torch.split(buffer, sizes, dim=1)):
            sp.full.data.view(buffer.shape[0], -1).copy_(column)   # .data: [Note: dim-0 shards]

    def free(self) -> None:
        """Back to FREE: the module holds its shards again, the whole parameters take 0 bytes."""
        if self.state == ShardState.FREE:
            return
        if self.state == ShardState.IN_FLIGHT:     # never free a buffer a collective is writing
            self._in_flight[0].wait()
            self._in_flight = None
        nbytes = self.full_bytes()
        for sp in self.params:
            sp.register(gathered=False)
            sp.release()
        self.state = ShardState.FREE
        events.emit("unit freed", engine=self.owner, unit=self, nbytes=-nbytes)

    def _keep_secondary(self) -> None:
        """reshard_after_forward=k: keep this rank's 1/k of every whole parameter, its part
        within its k ranks, for backward's all-gather among them."""
        group = self.groups.post_forward
        k, mine = comm.group_size(group), comm.group_rank(group)
        self.secondary = [sp.full.data.view(k, -1)[mine].clone() for sp in self.params]
        events.emit("secondary", engine=self.owner, unit=self,
                    nbytes=sum(t.nbytes for t in self.secondary))

    def drop_secondary(self) -> None:
        if self.secondary is not None:
            events.emit("secondary", engine=self.owner, unit=self,
                        nbytes=-sum(t.nbytes for t in self.secondary))
        self.secondary = None

    # --- the four hooks (fully_shard.py registers them) ------------------------------------------
    def pre_forward(self, module, args, kwargs):
        if self.training_state == TrainingState.PRE_BACKWARD:   # a recompute (activation
            self.gather(backward=True)                            # checkpointing) in backward
            return self._cast(args, kwargs)
        entering = self.training_state != TrainingState.FORWARD
        if entering:                                 # this forward runs all of its modules
            self._to_run = {id(m) for m in self.modules}
        self.training_state = TrainingState.FORWARD
        self.root.forward_starts(self)
        args, kwargs = self._cast(args, kwargs)
        self.gather()
        if entering:                     # (a unit of several modules: at the first of them)
            for unit in self.root.prefetch_targets(self, forward=True):
                unit.gather(prefetch=True)
            if torch.is_grad_enabled():
                args, kwargs = PostBackward.around(self, args, kwargs)
        return args, kwargs

    def post_forward(self, module, args, output):
        """After one of its modules: its forward ends when the last of them ran (one module: at
        once), or when the call stands alone (a module of the group called by itself)."""
        if self.training_state != TrainingState.PRE_BACKWARD:   # not a recompute
            self._to_run.discard(id(module))
            if not self._to_run or self.root.iteration_root is self:
                self.end_forward(output)
                self.root.forward_ends(self, output)
        if self.mp.output_dtype is None:
            return output
        return tree_map(lambda t: _cast(t, self.mp.output_dtype), output)

    def end_forward(self, output) -> None:
        """Its forward is over: free it (or keep 1/k of it, or all), and hook `output` (its own,
        or the root's when the forward skipped some of its modules) for its backward."""
        if self.after_forward is not False:                   # backward needs the parameters
            if self.after_forward is not True and torch.is_grad_enabled():
                self._keep_secondary()
            self.free()                           # <- stage 3's saving: free after forward
        self.post_forward_indices.append(self.root.ran_forward(self))
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self.pre_backward)
        self._to_run = set()
        self.training_state = TrainingState.IDLE

    def pre_backward(self, grad=None) -> None:
        """Its outputs' gradient is known: gather it (backward needs its parameters) and start
        the all-gather of the unit before it."""
        if self.training_state == TrainingState.PRE_BACKWARD:
            return
        self.root.backward_starts()
        self.training_state = TrainingState.PRE_BACKWARD
        self.gather(backward=True)
        for unit in self.root.prefetch_targets(self, forward=False):
            unit.gather(prefetch=True, backward=True)

    def post_backward(self) -> None:
        """Every gradient of this backward is in its parameters' .grad: reduce-scatter them (or,
        without gradient sync, keep them for the next backward), and free it."""
        self.training_state = TrainingState.POST_BACKWARD
        reduce = self.dtypes[1]
        if not self.reduce_grads:                        # set_requires_gradient_sync(False)
            for sp in self.params:
                sp.accumulate(reduce)
        grads = []
        for sp in self.params if self.reduce_grads else ():
            grad = sp.take_grad()
            if grad is None and self.reduce_unused and sp.requires_grad:   # unused on this rank
                grad = torch.zeros(sp.shape, dtype=self.dtypes[0], device=self.device)
            if grad is not None:
                grads.append((sp, grad))
        if self.reshard_after_backward:
            self.free()
        if grads:
            self.root.reduce(Reduction(self, grads))

    def end_backward(self) -> None:
        """Backward is over: IDLE; a prefetched all-gather nobody used is dropped."""
        self.training_state = TrainingState.IDLE
        self.drop_secondary()
        if self.state == ShardState.IN_FLIGHT:
            self.free()

    def reset_iteration(self, last_backward: bool) -> None:
        if last_backward:
            self.post_forward_indices.clear()

    def reset(self) -> None:
        """reset_iter_state: after a failed forward or backward, FREE and IDLE, the gradients of
        this iteration not reduced yet dropped."""
        self.free()
        self.drop_secondary()
        self.training_state = TrainingState.IDLE
        self._to_run, self.partial = set(), None
        self.post_forward_indices.clear()
        for sp in self.params:
            sp.take_grad()

    def across_replicas(self, output: torch.Tensor, op: str) -> torch.Tensor | None:
        """HSDP: this rank's reduce-scatter result, all-reduced down its mesh column (with the
        results kept while set_requires_all_reduce(False)); None while it keeps them."""
        if not self.all_reduce_grads:
            self.partial = output if self.partial is None else self.partial.add_(output)
            return None
        if self.partial is not None:
            output.add_(self.partial)
            self.partial = None
        comm.all_reduce(output, op=op, group=self.groups.replicate, tag=self.tag)
        return output

    def _cast(self, args, kwargs):
        """cast_forward_inputs: the floating inputs to param_dtype."""
        if not (self.mp.cast_forward_inputs and self.mp.param_dtype is not None):
            return args, kwargs
        return tree_map(lambda t: _cast(t, self.mp.param_dtype), (args, kwargs))


def _cast(t, dtype: torch.dtype):
    return t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t
