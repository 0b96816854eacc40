"""torch.nn.parallel.DistributedDataParallel as PyTorch users write it, on minizero's stage 0.

    model = minizero.DistributedDataParallel(model)              # in minizero.launch or torchrun
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # your optimizer, your loop
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()           # each p.grad: the gradient averaged over the ranks
    optimizer.step()

Run its tests:  python -m pytest tests/test_pytorch_ddp.py

This is ddp.py's stage 0 (the first row of stages.py's table) without the engine around it: the
gradients live in ddp.AllReducedGradients' flat buffer, cut into buckets in reverse parameter
order (flat.py), and reducer.GradBuckets starts each bucket's all-reduce the moment its last
gradient is complete, while backward goes on. So a learner sees the all-reduce, bucket by bucket,
that `minizero.wrap(model, 0, ...)` runs. What torch's DDP adds is in this file:

  * your optimizer: nothing here steps. After loss.backward() each p.grad holds the average, and
    optimizer.zero_grad() (set_to_none True or False) is safe (flat.FlatLayout.reclaim_grads);
  * loss.backward() finishes the reduction inside backward: the first gradient of the module's
    output queues a callback on autograd's engine for the end of backward (torch's Reducer queues
    its own the same way);
  * no_sync() (decided at forward, as torch does), find_unused_parameters, static_graph, buffers
    broadcast from the group's first rank before each forward, init_sync, and the `module.` prefix
    of state_dict keys (this is an nn.Module holding `module`). Every other keyword of torch 2.13's
    constructor is implemented or refused in one line (ddp_options.py).
  * uneven inputs: `with model.join():` or Join([model, optimizer]), torch's Join; a rank out of
    data shadows the others' collectives (ddp_join.py).

Where it differs from torch's (docs/pytorch.md): p.grad is always a view of its bucket, the memory
of gradient_as_bucket_view=True (torch's default, False, copies each gradient into its bucket and
back); buckets follow the parameters' reverse order, where torch rebuilds them after the first
iteration in the order the gradients arrived; with static_graph=True and a gradient that arrives
twice a backward, every backward all-reduces after its end (torch overlaps from the second).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.utils._pytree import tree_map

from minizero import comm, events, owners
from minizero.ddp import AllReducedGradients
from minizero.flat import FlatLayout
from minizero.pytorch import ddp_join, ddp_options
from minizero.pytorch.process_groups import group_of
from minizero.reducer import GradBuckets

OWNER = owners.Owner("minizero.DistributedDataParallel", ("minizero.ZeroRedundancyOptimizer",))


class DistributedDataParallel(nn.Module, Joinable):
    """torch 2.13's DistributedDataParallel(module, device_ids=None, ...), its keywords in its
    order. Collective: every rank of the process group builds it."""

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group=None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None,
                 skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: list[float] | None = None, batched_grad_copy: bool = False,
                 forward_sync_buffers: bool | None = None):
        super().__init__()
        Joinable.__init__(self)                   # torch's Join: not inside one (join() below)
        ddp_options.check_keywords(delay_all_reduce_named_params, param_to_hook_all_reduce,
                                   mixed_precision, skip_all_reduce_unused_params,
                                   check_reduction, batched_grad_copy, process_group, device_mesh)
        self.module = module
        self.dim, self.gradient_as_bucket_view = dim, gradient_as_bucket_view
        self.find_unused_parameters, self.static_graph = find_unused_parameters, static_graph
        self.forward_sync_buffers, init_sync_buffers = ddp_options.buffer_sync(
            broadcast_buffers, forward_sync_buffers)
        self.process_group = process_group if device_mesh is None else device_mesh
        self.group = group_of(self.process_group)           # None: every rank
        if self.group is not None and self.group.index < 0:
            raise ValueError(f"rank {comm.rank()} is not in process_group (ranks "
                             f"{list(self.group.ranks)}): only its members build the module")
        self.src = 0 if self.group is None else self.group.ranks[0]     # torch's rank 0
        # what torch names _ddp_params_and_buffers_to_ignore: neither reduced nor broadcast
        self.ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named = [(n, p) for n, p in module.named_parameters() if n not in self.ignored]
        self.names = {p: n for n, p in named}
        self.trainable = [p for _, p in named if p.requires_grad]
        self.device = ddp_options.check_module(module, self.trainable)
        self.device_ids, self.output_device = ddp_options.check_devices(self.device, device_ids,
                                                                        output_device)
        if init_sync:                             # every replica starts from the first rank's
            self._check_same_model()
            _broadcast([p for _, p in named] + (self._buffers_synced() if init_sync_buffers
                                                 else []), self.src, self.group, "initial values")
        self.grad_dtype = self.trainable[0].dtype
        self.bucket_bytes_cap = ddp_options.bucket_caps(bucket_cap_mb, bucket_cap_mb_list)
        self._build_reducer()

    def _build_reducer(self) -> None:
        """Stage 0's gradient family (ddp.py): one flat buffer in buckets, each all-reduced as soon
        as its gradients are complete. Its engine attributes are this module's: grad_dtype,
        device, sync (below) and group, the ranks it averages over."""
        owners.claim(self.trainable, OWNER, {id(p): n for p, n in self.names.items()})
        buckets = ddp_options.buckets(self.trainable[::-1], self.bucket_bytes_cap)   # reversed
        self.layout = FlatLayout.build(buckets, comm.group_size(self.group),
                                       comm.group_rank(self.group), pad=False)
        before = [p.grad for p in self.trainable]
        self.grads = AllReducedGradients(self, self.layout)        # makes each p.grad a view
        for p, grad in zip(self.trainable, before):
            p.grad = grad                  # as torch: None until the first backward, then a view
        # static_graph: in the first backward every bucket waits for its end, as the hooks may fire
        # more than once per parameter (reentrant checkpointing); _learn decides about the rest
        self.reducer = GradBuckets(self.layout.buckets, launch=self._launch, on_grad=self._arrived,
                                   max_in_flight=len(self.layout.buckets),
                                   overlap=not self.static_graph, owner=self)
        self.require_backward_grad_sync = True        # False inside no_sync()
        self.require_forward_param_sync = True        # the last forward synced: buffers are due
        self._sync = True                             # what the last forward decided
        self._in_backward = False
        self._unused: dict = {}              # none will get a gradient: from forward, in order
        self._fired: dict = {}               # parameters whose gradient arrived: how many times
        self._was_none: set = set()          # parameters whose grad was None before the reduce
        self._learned = None                 # static_graph, after its first backward: _learn
        self._divide_by_initial_world_size = True     # join(): ddp_join.py
        self._training = None                # under Join: how many ranks all-reduce this backward
        self._used_anywhere = None           # the last used-parameters agreement's answer

    # --- torch.save(model) / torch.load: the module and its settings, as torch's DDP -------------
    def __getstate__(self) -> dict:
        """The hooks, buckets and process group stay behind (torch's DDP drops its reducer and
        process group too); the gradients are not saved, as for any module."""
        runtime = {"layout", "grads", "reducer", "group", "process_group"}
        return {k: v for k, v in self.__dict__.items() if k not in runtime}

    def __setstate__(self, state: dict) -> None:
        """Loaded: on the default process group (as torch's DDP), with new buckets and hooks."""
        super().__setstate__(state)
        self.process_group = self.group = None
        self.src = 0
        self._build_reducer()

    @property
    def sync(self) -> bool:
        """Whether this backward all-reduces (AllReducedGradients asks): what the forward
        decided, as in torch, where no_sync() must hold the forward."""
        return self._sync

    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    # --- forward ----------------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        Join.notify_join_context(self)          # under Join: "this rank has data" (ddp_join.py)
        joining = self._join_config.enable
        if self.require_forward_param_sync and self.forward_sync_buffers:
            self._sync_buffers(ddp_join.common_rank(self, True) if joining else self.src)
        grad = torch.is_grad_enabled()
        self._sync = self.require_forward_param_sync = grad and self.require_backward_grad_sync
        if joining:                             # what the joined ranks shadow (ddp_join.py)
            self._training = ddp_join.vote(self, grad, self._sync)[1]
        if self.device_ids:
            inputs, kwargs = tree_map(self._to_device, (inputs, kwargs))
        output = self.module(*inputs, **kwargs)
        if grad:
            outputs = [t for t in _tensors_in(output) if t.requires_grad]
            if self._sync and self._learned is not None:                     # static_graph
                self._unused = dict.fromkeys(self._learned[0])
            elif self._sync and self.find_unused_parameters and not self.static_graph:
                reached = _parameters_reached(outputs)
                self._unused = dict.fromkeys(p for p in self.trainable if p not in reached)
            for t in outputs:
                t.register_hook(self._backward_starts)
        return output

    def _to_device(self, t):
        return t.to(self.device) if torch.is_tensor(t) else t

    # --- backward: [Note: loss.backward()] in engine.py, the same callback ------------------------
    def _backward_starts(self, grad: torch.Tensor) -> None:
        if self._in_backward:                            # a second output of the same forward
            return
        self._in_backward = True
        self._fired, self._was_none = {}, set()
        if self._sync:
            for p in self._unused:            # no gradient will come: their buckets need not wait
                self.reducer.mark_ready(p)
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)

    def _arrived(self, p: nn.Parameter, bucket) -> None:
        """The reducer, as p's gradient is complete."""
        if not self._in_backward:       # a backward through self.module(...), not through forward:
            self._backward_starts(None)      # reduced all the same, not left half counted
        if self._sync and self.reducer.overlap and (p in self._fired or p in self._unused):
            why = ("static_graph=True promised the graph of the first iteration" if
                   self.static_graph else "pass static_graph=True, or checkpoint with "
                   "use_reentrant=False")
            raise RuntimeError(
                f"DistributedDataParallel: {self.names[p]}'s gradient arrived twice in one "
                "backward (torch: 'Expected to mark a variable ready only once'), or after "
                "forward found it unused (a module checkpointed with "
                f"use_reentrant=True?): {why}")
        self._fired[p] = self._fired.get(p, 0) + 1

    def _launch(self, bucket):
        """The reducer, inside backward: bucket's gradients are complete; start its all-reduce."""
        if self._sync and (self.find_unused_parameters or self.static_graph):
            self._was_none.update(p for p in bucket.params if p.grad is None)
        if self._join_config.enable and not self._divide_by_initial_world_size:
            return ddp_join.reduce_over_training(self, bucket, self._training)
        return self.grads.reduce(bucket)        # ddp.py: the essential line of DDP

    def _backward_ends(self) -> None:
        self._in_backward = False
        self.reducer.finish()          # launch what is left (unused parameters: zeros), wait all
        self._unused = {}                    # forward's, for its backward only (not a later one)
        if self._sync and (self.find_unused_parameters or self.static_graph):
            self._leave_globally_unused()
        elif self._sync and len(self._fired) < len(self.trainable):
            missing = [self.names[p] for p in self.trainable if p not in self._fired]
            raise RuntimeError(
                f"DistributedDataParallel: {len(missing)} parameter(s) got no gradient in this "
                f"backward ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): "
                "pass find_unused_parameters=True (torch's DDP needs it too), or use them")
        events.emit("backward done", engine=self)

    def _leave_globally_unused(self) -> None:
        """torch's rule: a parameter no rank used keeps its grad untouched (None stays None, so
        the optimizer skips it); one that some rank used gets the average, zeros from the rest."""
        if self._learned is not None:                  # static_graph: the first backward's answer
            nobody = self._learned[1]
        else:
            used = torch.tensor([p in self._fired for p in self.trainable], dtype=torch.int32,
                                device=self.device)
            comm.all_reduce(used, op="max", async_op=True, group=self.group,
                            tag="used parameters").wait()           # async: [Note: every forward]
            self._used_anywhere = used          # a joined rank's answer (ddp_join.py, as torch)
            nobody = {p for p, anywhere in zip(self.trainable, used.tolist()) if not anywhere}
            if self.static_graph:
                self._learn(nobody)
        for p in self._was_none & nobody:
            p.grad = None

    def _learn(self, nobody: set) -> None:
        """static_graph, after the first backward (torch's rule: the graph stays the same): the
        parameters this rank does not use are ready when backward starts, and nobody's grad stays
        None, without asking the others again. If every gradient arrived once, later buckets are
        all-reduced during backward; if one arrived twice (reentrant checkpointing), after it."""
        self._learned = ([p for p in self.trainable if p not in self._fired], nobody)
        self.reducer.overlap = all(times == 1 for times in self._fired.values())

    @contextlib.contextmanager
    def no_sync(self):
        """Forward and backward inside the block only accumulate p.grad locally; the first
        forward-backward after it all-reduces the sum."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # --- uneven inputs: torch's Join (ddp_join.py) ----------------------------------------------
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """torch's context manager for ranks with different numbers of batches: a rank out of data
        shadows the others' collectives; at the end every rank holds the last one's model. With
        throw_on_early_termination, every rank raises once one runs out."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> ddp_join.ShadowIteration:
        return ddp_join.ShadowIteration(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return ddp_join.process_group(self)

    def _sync_buffers(self, src: int) -> None:
        _broadcast(self._buffers_synced(), src, self.group, "buffers", wait_later=True)

    def _sync_final_model(self, src: int) -> None:
        _broadcast(list(self.names) + (self._buffers_synced() if self.forward_sync_buffers
                                       else []), src, self.group, "final model")

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, names) -> None:
        """torch's way (libraries call it) to name what DDP neither reduces nor broadcasts: the
        attribute __init__ reads."""
        module._ddp_params_and_buffers_to_ignore = list(names)

    # --- what torch's DDP also has, not here ------------------------------------------------------

    def register_comm_hook(self, state, hook):
        raise NotImplementedError("DistributedDataParallel.register_comm_hook is not supported: "
                                  "minizero all-reduces each bucket with comm.all_reduce")

    # --- helpers ----------------------------------------------------------------------------------
    def _buffers_synced(self) -> list[torch.Tensor]:
        """The buffers broadcast from the first rank (read each time: a module may reassign one)."""
        return [b for n, b in self.module.named_buffers() if n not in self.ignored]

    def _check_same_model(self) -> None:
        """torch's _verify_param_shape_across_processes: every rank holds the same parameters
        (their count and elements), or each raises one line instead of hanging."""
        sizes = [len(self.names), sum(p.numel() for p in self.names)]
        both = torch.tensor(sizes + [-s for s in sizes], dtype=torch.int64, device=self.device)
        comm.all_reduce(both, op="max", group=self.group, tag="model sizes")
        if both[:2].tolist() != sizes or (-both[2:]).tolist() != sizes:
            raise ValueError(f"DistributedDataParallel: the model differs across ranks (rank "
                             f"{comm.rank()}: {sizes[0]} parameters, {sizes[1]:,} elements)")


def _tensors_in(output) -> list[torch.Tensor]:
    """The tensors of a forward's output, where torch's DDP looks for them: in tensors, lists,
    tuples (named too), dicts (a Hugging Face ModelOutput) and dataclasses, nested."""
    if torch.is_tensor(output):
        return [output]
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        output = [getattr(output, field.name) for field in dataclasses.fields(output)]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors_in(item)]
    return []


def _parameters_reached(outputs: list[torch.Tensor]) -> set:
    """The leaves autograd reaches from `outputs`: the parameters this forward used (torch's
    find_unused_parameters walks the same graph)."""
    seen, found = set(), set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    found.update(t for t in outputs if t.grad_fn is None)                  # an output is a leaf
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):                                      # AccumulateGrad
            found.add(node.variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _broadcast(tensors: list[torch.Tensor], src: int, group, tag: str,
               wait_later: bool = False) -> None:
    """The first rank's values of `tensors` on every rank of the group: one broadcast per dtype
    (torch's _broadcast_coalesced), without bumping the tensors' version counters (a buffer saved
    for a backward still to come stays valid, as in torch).

    [Note: every forward] wait_later: issued asynchronously and waited for at once, which is the
    same for the values. The difference is beyond/desync.py's: it agrees with the other ranks
    before every *blocking* collective, a round trip that torch's DDP does not make before each
    forward; the broadcast's fingerprint is still in the agreement at the end of backward."""
    by_kind: dict = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(tensors)):
        for same in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            handle = comm.broadcast(flat, src=src, async_op=wait_later, group=group, tag=tag)
            if handle is not None:
                handle.wait()
            offset = 0
            for t in same:
                t.copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()
