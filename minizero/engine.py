"""The engine every stage shares: backward, step, no_sync, gathered, memory.

    engine = minizero.wrap(model, stage, functools.partial(torch.optim.AdamW, lr=1e-3))
    loss = loss_fn(engine(x), y)     # forward
    engine.backward(loss)            # backward + gradient communication
    engine.step()                    # clip, optimizer step on what this rank owns, share the result

An engine is built from one row of the ZeRO paper's table (stages.py): a *parameters* family
(P_p: ddp.ReplicatedParameters or zero3.ShardedUnits), a *gradients* family (P_g:
ddp.AllReducedGradients, zero1.GradientsReducedAtStep or zero2.GradientShard), and whether the
optimizer is given this rank's partition (P_os) or everything. __init__ builds them in that order,
top to bottom; backward() and step() call each family at its moment:

    backward   params.before_backward -> loss.backward() [reducer: params.bucket_ready(b,
               grads.reduce) per complete bucket] -> reducer.finish -> params.after_backward
    step       grads.parts() -> (HSDP, fp16, clip) -> optimizer.step -> params.after_step ->
               grads.zero()

The engine holds three small frozen policies (options.py), checked in one place (Engine.check,
which wrap.check, the CLI and the config reader call before anything is built): `precision`
(Precision), `offloading` (Offload: where P_os lives, offload.py and beyond/disk.py) and `groups`
(Groups, from Sharding: [Note: the 2-D mesh], [Note: hierarchical sharding] below; hpZ in zero3.py).

Mixed precision: dtype "fp32", "bf16" or "fp16" (the model computes in it; the optimizer keeps fp32
masters, optim.py). fp16 also scales the loss (loss_scale.py): loss_scale=None (dynamic), a number
(static) or a dict. reduce_dtype: None (the gradients are reduced and accumulated in dtype) or
"fp32" (bf16/fp16 runs: in fp32, FSDP2's MixedPrecisionPolicy.reduce_dtype, DeepSpeed's
data_types.grad_accum_dtype). Autograd still produces each p.grad in dtype;
flat.FlatLayout.point_grads_into adds it into the fp32 buffers that are reduced. The paper's
2 + 2 + K bytes per parameter become 2 + 4 + K, and the gradient collectives move 4 bytes an element
instead of 2 (memory.grad_bytes, memory.comm_volume). For fp32 it is the default.

[Note: the 2-D mesh] wrap(..., tensor_parallel=M) cuts the N ranks into rows of M consecutive
ranks, each row one tensor-parallel group that splits every block (beyond/tensor_parallel.py), and
columns of N_d = N/M ranks that hold the same split: the data-parallel group. ZeRO is data
parallelism, so everything below that says "over the N ranks" runs over the column (`data_group`,
which becomes the shard group): gradients are averaged, partitions cut and gathered among the N_d
ranks, and each rank's model is its tensor-parallel part. Two things see the rows: the global
gradient norm (_clip: a split parameter's squares are summed over the row, a replicated one counted
once) and the fp16 overflow check (every rank, as always). Without tensor parallelism both groups
are None.

[Note: hierarchical sharding] The paper's ZeRO partitions over all N ranks. shard_group_size=S
(stages 1-3; FSDP2's HSDP, DeepSpeed's MiCS) partitions within groups of S consecutive ranks
(`shard_group`, one row of comm.mesh(S)) and replicates across the N/S groups (`replicate_group`,
the ranks that hold the same partition: one column). Per rank, S replaces N in every sharded term of
the memory formulas. The flat layout cuts each bucket into S partitions (its shard index:
comm.group_rank(shard_group)); gradients are reduce-scattered within the shard group (the average
over its S ranks) and, at step(), this rank's partition is all-reduced across the replicate group
(the average over the N/S groups): the average over all N. Parameters are all-gathered within the
shard group. With S a node's size every collective but that small all-reduce (2(N/S-1)/(N/S)·Ψ/S)
stays inside the node. S = N (the default, None) is the paper's ZeRO: shard_group and
replicate_group are None and nothing here changes a byte. The marked lines of the families pass
the shard group; ZeRO++'s hpZ (hpz_group_size, zero3.py) adds a third group, a node's R
ranks, for stage 3's backward all-gather.

Measurement: memory() gives this rank's model-state bytes and the activations' peak
(beyond/activations.py); `with engine.memory_timeline() as timeline:` records one (time, event,
bytes by category) per event of the event stream (events.py). Both are memory/meter.py, which
subscribes to the events; the engine only emits them.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from minizero import checkpoint, comm, construct, events, owners
from minizero.beyond import activations, quantize
from minizero.beyond import tensor_parallel
from minizero.absent import refuse_dropped_writes
from minizero.loss_scale import scaler_for
from minizero.memory.meter import ModelStateMeter
from minizero.offload import optimizer_home
from minizero.optim import Grouping, Placement, SteppedHome, group_runs, parse_param_groups
from minizero.options import (Offload, Precision, Sharding, StageOptions, check_options)
from minizero.reducer import GradBuckets

class Engine:
    """Built from `row`, a stages.Stage: each stage's engine class (stages.py) sets it."""
    row = None
    owner_kind, composes_with = None, ()       # how owners.py names it; the owners it works beside
    int8_codec = quantize.Int8Blocks   # ZeRO++'s codec (beyond/quantize.py); a subclass may bring
    #                                    its own

    def __init__(
        self,
        model: nn.Module,
        optimizer,
        *,
        dtype: str = "fp32",
        offload: bool | str = False,
        clip_grad_norm: float | None = None,
        loss_scale: float | dict | None = None,
        reduce_dtype: str | None = None,
        shard_group_size: int | None = None,
        hpz_group_size: int | None = None,
        offload_path: str | None = None,
        param_groups: list[dict] | None = None,
        mesh: tuple[comm.Group, comm.Group] | None = None,
        **stage_options,
    ):
        self.check(dtype, offload, reduce_dtype, shard_group_size, hpz_group_size,
                   offload_path=offload_path)
        check_options(self.stage, stage_options)         # TypeError: not an option of this stage
        # fp16: the loss is multiplied by S before backward, the gradients divided by it in step()
        self.scaler = scaler_for(dtype, loss_scale)
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be > 0, got {clip_grad_norm!r}")
        if not callable(optimizer):
            raise TypeError("optimizer must be a factory params -> torch.optim.Optimizer, "
                            "e.g. functools.partial(torch.optim.AdamW, lr=1e-3)")
        self.module = model
        self.optimizer_factory = optimizer
        self.options = StageOptions(**stage_options)
        # the three policies (options.py), checked above
        self.precision = Precision(dtype, reduce_dtype, loss_scale)
        self.offloading = Offload(offload, offload_path)
        self.clip_grad_norm = clip_grad_norm
        self.rank, self.world_size, self.device = comm.rank(), comm.world_size(), comm.device()
        # this rank's groups: [Note: the 2-D mesh] (tensor, data), [Note: hierarchical sharding]
        # (shard: who it partitions with, None for all N; replicate) and hpZ's (zero3.py)
        self.groups = Sharding(shard_group_size, hpz_group_size).groups(mesh)
        self.tensor_group, self.data_group = self.groups.tensor, self.groups.data
        self.shard_group, self.replicate_group = self.groups.shard, self.groups.replicate
        self.hpz_group = self.groups.hpz
        self.sync = True                              # False inside no_sync()
        self.accumulating = False                     # a no_sync() backward ran since the last step
        self.mid_step = False          # a backward() ran, its step() not yet: checkpoints refuse
        self.last_grad_norm: float | None = None
        self.step_count = 0            # steps taken, skipped ones included; a checkpoint saves it

        # Mixed precision: the model computes in self.dtype (floating params and buffers are
        # cast; the optimizer keeps fp32 masters, see optim.py). A model built by
        # minizero.sharded_init holds only partitions: those are cast (construct.py), and they
        # hold rank 0's values already.
        # from here on the parameters are this engine's (owners.py: a second one is refused)
        self.owner = owners.Owner(self.owner_kind or f"a minizero stage-{self.stage} engine",
                                  self.composes_with)
        owners.claim(model.parameters(), self.owner,
                     {id(p): name for name, p in model.named_parameters()})
        construct.cast_partitions(model, self.device, self.dtype)
        model.to(device=self.device, dtype=self.dtype)
        self._broadcast_from_rank0()
        # distinct: a tied weight appears once; the Parameter objects never change (the families
        # move only p.data)
        self.model_params = list(model.parameters())
        self.trainable = [p for p in self.model_params if p.requires_grad]
        # frozen ones are replicated as-is (stage 3: partitioned), never stepped
        self.frozen = [p for p in self.model_params if not p.requires_grad]
        # the optimizer's groups [Note: parameter groups] in optim.py: param_groups, each group's
        # settings, and group_of, {id(parameter): its group}; None: one group of every trainable one
        self.param_groups = self.group_of = None
        if param_groups is not None:
            self.param_groups, self.group_of = parse_param_groups(
                param_groups, list(model.named_parameters()))

        # The stage's row of the table (stages.py), family by family.
        # P_p: where the parameters live, and the flat layout of their buckets (flat.py)
        groups = self.row.buckets(self.trainable, self.options.bucket_size) \
            if self.row.buckets else None                   # stage 3: each unit is a bucket
        self.params = self.row.parameters(self, groups, self.options)
        self.layout = self.params.layout
        # P_g: where the gradients live, and how a complete bucket is reduced
        self.grads = self.row.gradients(self, self.layout, self.options)
        self.reducer = GradBuckets(
            self.layout.buckets, launch=self._bucket_ready, done=self.grads.arrived,
            on_grad=self.grads.on_grad, max_in_flight=self.options.buckets_in_flight,
            overlap=self.options.overlap, owner=self) if self.grads.in_backward else None
        # P_os: the optimizer gets what this rank steps: Ψ/N (stages 1-3) or Ψ (DDP)
        # (a row may bring its own home: beyond/muon/ for matrices, FSDP's for the user's optimizer)
        home = self.row.optimizer or optimizer_home(self.offload, self.offloading.path)
        buckets = self.layout.buckets                               # where each part sits:
        placement = Placement(buckets, [self._start(b) for b in buckets], self.shard_group)
        # <- the essential line of P_os: it is handed Ψ/N parameters (optim.OptimizerHome)
        self.optimizer: SteppedHome = home(self.params.optimizer_parts(), optimizer,
                                           self._grouping(), placement)

        # ZeRO-R: what forward saves (beyond/activations.py); model states: memory/meter.py
        self.activations = activations.SavedTensorMeter(self.params.param_tensors)
        self.meter = ModelStateMeter(self, self._memory_groups)
        # a plain loss.backward() is found from the model's output ([Note: loss.backward()])
        self._in_backward = False
        self.hooks = [model.register_forward_hook(self._forward_ends)]

    @property
    def stage(self) -> int:
        return self.row.number

    @property
    def sharded(self) -> bool:
        """Stages 1-3: the optimizer steps a partition, gradients are partitioned."""
        return self.row.partitioned

    @classmethod
    def check(
        cls,
        dtype: str = "fp32",
        offload: bool | str = False,
        reduce_dtype: str | None = None,
        shard_group_size: int | None = None,
        hpz_group_size: int | None = None,
        world_size: int | None = None,
        offload_path: str | None = None,
    ) -> None:
        """Raise ValueError (one line) unless this stage's engine takes these policies (options.py:
        Precision, Offload, Sharding, at `world_size` ranks, default this process group's). The
        engine checks them when it is built; wrap.check, the CLI and the config reader call this
        before anything is built or any process started."""
        Precision(dtype, reduce_dtype)
        Offload(offload, offload_path).check(cls.row.number)
        Sharding(shard_group_size, hpz_group_size).check(cls.row.number, world_size)

    @property
    def dtype(self) -> torch.dtype:
        """What the model computes in (self.precision)."""
        return self.precision.compute

    @property
    def grad_dtype(self) -> torch.dtype:
        """What gradients are reduced and accumulated in (self.precision)."""
        return self.precision.grads

    @property
    def offload(self) -> bool | str:
        return self.offloading.where

    def _broadcast_from_rank0(self) -> None:
        """All replicas start from rank 0's weights and buffers, whatever each
        process initialised."""
        src = 0 if self.data_group is None else self.data_group.ranks[0]   # [Note: the 2-D mesh]
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                if construct.partition_of(t) is None:
                    comm.broadcast(t.data, src=src, group=self.data_group,
                                   tag="rank 0's initial values")

    def _start(self, b) -> int:
        """Where the part of bucket b this rank steps starts: its partition, or 0 unsharded."""
        return self.layout.rank * b.shard_numel if self.sharded else 0

    def _grouping(self) -> Grouping | None:
        """The parameter groups as this rank's optimizer sees them: for each bucket, the runs of
        its elements that this rank steps (its partition, or the whole bucket unsharded), cut where
        the group changes. None without groups."""
        if self.param_groups is None:
            return None
        runs = []
        for b in self.layout.buckets:
            size = b.shard_numel if self.sharded else b.padded_numel
            runs.append(group_runs(b, self._start(b), self._start(b) + size, self.group_of))
        return Grouping(self.param_groups, runs, self.group_of)

    def keeps_gathered(self, unit) -> bool:
        """Whether a stage-3 unit stays gathered after its forward (FSDP's
        reshard_after_forward=False: fairscale/fsdp_engine.py); here never."""
        return False

    # --- forward ----------------------------------------------------------------------------------
    def __call__(self, *inputs, **kwargs):
        with self.activations.recording():
            return self.module(*inputs, **kwargs)

    # --- backward ---------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            loss = self.scaler.scale_loss(loss)         # every gradient S times larger (chain rule)
        self._in_backward = True                        # not a plain loss.backward(): see below
        self._enter_backward()
        loss.backward()
        self._in_backward = False
        self.end_backward()
        events.emit("backward done", engine=self)

    def _enter_backward(self) -> None:
        self.accumulating |= not self.sync              # p.grad holds what no_sync() accumulated
        self.mid_step = True
        self.params.before_backward()

    # [Note: loss.backward()] PyTorch users write loss.backward(), and torch's DDP finishes its
    # gradient all-reduce inside it. So does this engine: a hook on the model's output tensors sees
    # backward start (their gradients are the first it computes) and queues a callback on autograd's
    # engine for its end (torch's DDP and FSDP do the same), which runs what engine.backward() runs
    # after loss.backward(). fp16 is the exception: its loss must be scaled first (loss_scale.py),
    # which only engine.backward() can do, so a plain loss.backward() is refused in one line rather
    # than stepped with unscaled gradients.
    def _forward_ends(self, module, args, output) -> None:
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self._backward_starts)

    def _backward_starts(self, grad: torch.Tensor) -> None:
        if self._in_backward:                           # engine.backward(), or a second output
            return
        if self.scaler is not None:
            raise RuntimeError("fp16: call engine.backward(loss), not loss.backward(): the loss "
                               "must be scaled first (dynamic loss scaling)")
        self._in_backward = True
        self._enter_backward()
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)

    def _backward_ends(self) -> None:
        self._in_backward = False
        self.end_backward()
        events.emit("backward done", engine=self)

    def _bucket_ready(self, b):
        """The reducer, inside backward: every gradient of bucket b is complete. Parameters first
        (stage 3: the unit's post-backward), which hand it to the gradients' reduce."""
        return self.params.bucket_ready(b, self.grads.reduce)

    def end_backward(self) -> None:
        """Finish what backward started: launch the buckets not launched yet (unused parameters:
        zeros) and wait for all; stage 3 frees its units."""
        if self.reducer is not None:
            self.reducer.finish()
        self.params.after_backward()

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward inside this block only accumulates locally
        (no communication). The first backward outside it reduces the sum of all
        accumulated micro-batches."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    # --- step -------------------------------------------------------------------------------------
    def step(self) -> None:
        grads = self.grads.parts()                         # stage 1: the reduce-scatter is here
        if self.replicate_group is not None:               # [Note: hierarchical sharding]
            for b, g in zip(self.layout.buckets, grads):   # average over the N/S groups: over all N
                comm.all_reduce(
                    g, op="avg", group=self.replicate_group, tag=f"bucket {b.index} across"
                )
        if self.scaler is not None:              # fp16: the gradients are still S times too large
            grads = self.scaler.unscale(grads)   # fp32 / S; None: some rank overflowed
        if grads is not None:                    # (None: every rank skips this step, loss_scale.py)
            if self.clip_grad_norm is not None:
                self.last_grad_norm = self._clip(grads)
            self.optimizer.step(grads)
            events.emit("optimizer step", engine=self)
            self.params.after_step()             # stages 1-2: all-gather the updated partitions
            events.emit("step", engine=self)
        self.grads.zero()
        self.accumulating = self.mid_step = False
        self.activations.new_step()
        self.step_count += 1

    def _clip(self, grads: list[torch.Tensor]) -> float:
        """Clip by the *global* norm. With sharded gradients each rank only sees its
        partition, so the squares are summed locally and then over ranks; clipping each shard
        by its own norm (a classic mistake) would give every rank a different scale. Same
        formula as torch.nn.utils.clip_grad_norm_."""
        if self.tensor_group is not None:                      # [Note: the 2-D mesh]
            squares = self._mesh_squares(grads)
            comm.all_reduce(squares, op="sum", tag="gradient norm")        # over the whole mesh
        else:
            squares = torch.zeros((), dtype=torch.float32, device=self.device)
            for g in grads:
                squares += g.float().pow(2).sum()
            if self.sharded:
                # squares over all partitions
                comm.all_reduce(squares, op="sum", group=self.shard_group,
                                tag="gradient norm")
        norm = squares.sqrt()
        scale = (self.clip_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
        return norm.item()

    def _mesh_squares(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """This rank's share of ‖g‖² on the mesh: its elements of split parameters, and 1/M of
        those of replicated ones (every rank of the row holds them alike), so that the sum over
        all N ranks counts each element of the whole model once."""
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        weight = (1.0, 1.0 / self.tensor_group.size)          # split, replicated; padding: None
        for b, g in zip(self.layout.buckets, grads):
            start = comm.group_rank(self.shard_group) * g.numel() if self.sharded else 0
            kind = {id(p): int(not tensor_parallel.is_split(p)) for p in b.params}
            for lo, hi, k in group_runs(b, start, start + g.numel(), kind):  # this rank's runs
                if k is not None:
                    squares += g[lo:hi].float().pow(2).sum() * weight[k]
        return squares

    @property
    def loss_scale(self) -> float:
        """S, the factor the next backward multiplies the loss by (1.0 unless fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because the fp16 gradients overflowed on some rank."""
        return self.scaler.skipped_steps if self.scaler is not None else 0

    # --- results ----------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict (keys as model.state_dict()), on CPU, trainable
        parameters in fp32 from the master weights. Collective: every rank must call it; every
        rank gets the result."""
        values = {}
        for b, master in zip(self.layout.buckets, self.optimizer.master_values()):
            full = master
            if self.sharded:                                  # rebuild the bucket from N partitions
                full = torch.empty(b.padded_numel, dtype=torch.float32, device=self.device)
                comm.all_gather(full, master.to(self.device).contiguous(),   # host masters: offload
                                group=self.shard_group, tag=f"bucket {b.index} masters")
            for p, view in b.views(full):
                values[id(p)] = view.detach().cpu().clone()
        out = {}
        with self.gathering(self.frozen):                 # stage 3 partitions frozen parameters too
            for name, t in self.module.state_dict(keep_vars=True).items():
                value = values.get(id(t))
                if value is None:                              # frozen parameter or buffer
                    value = t.detach().cpu().clone()
                    if value.is_floating_point():
                        value = value.float()
                out[name] = value
        return out

    # --- full parameters between steps ------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self, modules: list[nn.Module] | None = None, modifier_rank: int | None = None):
        """Inside the block the full parameters of `modules` (default: the whole model) are readable
        on every rank: DeepSpeed's GatheredParameters, FSDP's summon_full_params. With
        modifier_rank=r, what rank r writes to them is given to every rank when the block ends, and
        to the optimizer's master weights. Collective, between steps. Stages 0-2 hold full
        parameters already; stage 3 gathers. At stage 3 a write with modifier_rank=None could not
        take effect (each rank keeps the partition it had): every rank raises
        absent.ParameterWriteError at the end of the block, as DeepSpeed's GatheredParameters
        does."""
        if modifier_rank is not None and self.tensor_group is not None:
            raise ValueError("gathered(modifier_rank=...) with tensor parallelism: each row holds "
                             "other parts of the model, so one rank's writes cannot reach all; "
                             "not supported yet")
        if modifier_rank is not None and not (isinstance(modifier_rank, int) and
                                              0 <= modifier_rank < self.world_size):
            raise ValueError(f"modifier_rank must be a rank in 0..{self.world_size - 1} or None, "
                             f"got {modifier_rank!r}")
        modules = [self.module] if modules is None else list(modules)
        params = [p for m in modules for p in m.parameters()]
        held = self.params.for_user           # stages 0-2: None, a write stays this rank's own
        with self.gathering(params, modifier_rank):
            marks = None if modifier_rank is not None or held is None else held.write_marks(params)
            yield
            if marks is not None:
                refuse_dropped_writes(held.write_marks(params), marks)

    @contextlib.contextmanager
    def gathering(self, params: list[nn.Parameter], modifier_rank: int | None = None):
        """gathered() for a list of parameters (checkpoints use it for the frozen ones)."""
        params = list({id(p): p for p in params}.values())
        self.meter.measure()         # between steps anything may have changed (a checkpoint loaded)
        held = self.params.for_user                 # stages 0-2: None, the parameters are there
        if held is not None:
            held.gather(params)
        try:
            yield
            if modifier_rank is not None:
                with torch.no_grad():
                    for p in params:
                        comm.broadcast(p.data, src=modifier_rank,   # rank r's values, everywhere
                                       tag="gathered(modifier_rank)")
                self.after_user_write(params)
        finally:
            if held is not None:
                held.release()

    def after_user_write(self, params: list[nn.Parameter]) -> None:
        """The full parameters were written (gathered(modifier_rank), a checkpoint, FSDP's
        summon_full_params): stage 3 takes its partitions of them; the masters follow."""
        if self.params.for_user is not None:
            self.params.for_user.after_write(params)
        if any(p.requires_grad for p in params):
            self.optimizer.reload()

    # --- checkpoints: sharded, bit-exact resume (format and guarantees: minizero/checkpoint.py) ---
    def save(self, directory: str) -> None:
        """Collective, between steps (CheckpointError after a backward() whose step() has not
        run): every rank writes its shard to `directory`, rank 0 commits it."""
        checkpoint.save(self, directory)

    def load(self, directory: str) -> None:
        """Collective, between steps: restore a checkpoint of the same model and optimizer class,
        saved at any stage, world size, dtype or offload (resharded); on any mismatch raise
        checkpoint.CheckpointError (one line) on every rank, with nothing modified."""
        checkpoint.load(self, directory)

    # --- measurement (memory/meter.py) ------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """This rank's model-state bytes now: params, grads, optimizer (compute device), offloaded
        (host), and the peaks seen so far (`peak`: all device model states, `peak_params`:
        parameters alone); and `activations`: the peak bytes saved for backward during the current
        or last step (ZeRO-R; not in `peak`, which is the model states' figure)."""
        now = self.meter.measure()
        return {**now, **self.meter.peaks, "activations": self.activations.peak,
                "disk": self.optimizer.disk_bytes()}  # the disk tier (beyond/disk.py), else 0

    def _memory_groups(self) -> dict[str, list[torch.Tensor]]:
        """{category: the tensors holding it}: each family's buffers and the optimizer's."""
        families = (self.params, self.grads)
        return {
            "params": self.params.param_tensors() + [t for f in families
                                                     for t in f.tensors("params")],
            "grads": [p.grad for p in self.model_params] + [t for f in families
                                                            for t in f.tensors("grads")],
            "optimizer": self.optimizer.device_tensors(),
            "offloaded": self.optimizer.host_tensors() + [t for f in families
                                                          for t in f.tensors("offloaded")],
        }

    def memory_timeline(self):
        """Inside the block: a list of (time, event, bytes by category now) at each of this engine's
        events: "forward i", "backward i", "bucket k launched", "bucket k arrived", "end of
        backward", "step"; the categories as memory() counts them, plus the activations alive."""
        return self.meter.timeline(self.activations)

    def watch(self, units: list[nn.Module]) -> None:
        """Tell the event stream where each unit's forward ends and its backward starts (wrap
        calls it with the model's units, at every stage): what memory_timeline() and the
        step-through show."""
        for i, unit in enumerate(units):
            unit.register_forward_hook(
                lambda module, args, output, i=i: self._on_unit_forward(i, output)
            )

    def _on_unit_forward(self, i: int, output) -> None:
        events.emit("unit forward", engine=self, index=i)
        # its output's gradient arrives: its backward starts (the first output tensor that
        # needs one)
        needs_grad = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
        if needs_grad:
            needs_grad[0].register_hook(
                lambda grad: events.emit("unit backward", engine=self, index=i)
            )
