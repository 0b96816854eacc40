"""The engines users get: the paper's (engine.py, stages.py) with everything around it composed in.

    engine = minizero.wrap(model, 3, optimizer, dtype="fp16", shard_group_size=2)
    type(engine).__mro__        # assembled.Zero3, Assembled, stages.Zero3, engine.Engine

wrap, initialize (deepspeed/) and FullyShardedDataParallel (fairscale/) build these. The reading
path (minizero/__init__.py) stops at the paper; this file is where each piece beyond it plugs in,
through the core's extension points (its families, their routes, its policies, its events), so that
the core keeps no branch and no state for any of them:

  what a user needs around the paper      how it plugs in
    policies checked before anything runs  check(): options.Precision, Offload, Sharding
    fp16's loss scaling                    backward scales, averaged_gradients unscales or skips
    a plain loss.backward()                hooks on the model's output ([Note: loss.backward()])
    one owner per parameter                owners.claim
    a model built by sharded_init          construct.cast_partitions, units.ModelUnits' values
    parameter groups                       param_groups.ParamGroups, the core's param_groups=
    the units of any model, gathered()     stage 3's family: units.ModelUnits
    full_state_dict, save / load           gathered(), checkpoint.py
    memory(), memory_timeline()            memory/meter.py and beyond/activations.py, on events
  what came after the paper (beyond/)
    HSDP / MiCS shard groups               the core's group=, hierarchical.average_across
    tensor parallelism on a 2-D mesh       group= the column, tensor_parallel.squared_norm
    ZeRO++ qwZ, qgZ, hpZ                   routes: units.ModelUnit, quantize.Int8GradientShard
    checkpointable optimizer homes         the core's home= (homes.py; the disk tier's: beyond/)

The events these pieces emit, beside the core's (events.py):

    unit forward       assembled.py, a unit's forward has ended (index: in wrap's units)
    unit backward      assembled.py, its backward starts (index)
    secondary          beyond/hpz.py, hpZ's node-local copy kept (+nbytes) or dropped (-nbytes)
    collective modeled beyond/network.py, a collective booked on the modelled link: seq, kind,
                       start, end
    checkpoint commit  checkpoint.py, every rank's shard is on disk, the manifest not yet written:
                       directory
    ring exchange      ring.py, before each exchange: buffer (the padded tensor), send (the
                       index of the chunk this rank sends)
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from minizero import checkpoint, comm, construct, events, owners, stages
from minizero.absent import refuse_dropped_writes
from minizero.beyond import activations, hierarchical, quantize, tensor_parallel
from minizero.beyond.disk import DiskShardOptimizer
from minizero.homes import DeviceHome, HostHome
from minizero.loss_scale import scaler_for
from minizero.memory.meter import ModelStateMeter
from minizero.options import Offload, Options, Precision, Sharding, check_options
from minizero.param_groups import ParamGroups
from minizero.units import ModelUnits


class Assembled:
    """What every engine of wrap / initialize / FSDP adds to its stage's core engine (a mixin:
    assembled.DDP is Assembled + stages.DDP, ...). Read engine.py first."""
    options_class = Options
    owner_kind, composes_with = None, ()       # how owners.py names it; the owners it works beside
    int8_codec = quantize.Int8Blocks   # ZeRO++'s codec (beyond/quantize.py); a subclass may bring
    #                                    its own (exercise 13's grader)

    def __init__(self, model: nn.Module, optimizer, *, dtype: str = "fp32",
                 offload: bool | str = False, clip_grad_norm: float | None = None,
                 loss_scale: float | dict | None = None, reduce_dtype: str | None = None,
                 shard_group_size: int | None = None, hpz_group_size: int | None = None,
                 offload_path: str | None = None, param_groups: list[dict] | None = None,
                 mesh: tuple[comm.Group, comm.Group] | None = None, **stage_options):
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
        # the three policies (options.py), checked above
        self.precision = Precision(dtype, reduce_dtype, loss_scale)
        self.offloading = Offload(offload, offload_path)
        # this rank's process groups: the 2-D mesh's (tensor, data: beyond/tensor_parallel.py),
        # HSDP's (shard: who it partitions with, None for all N; replicate: hierarchical.py), hpZ's
        pgs = self.process_groups = Sharding(shard_group_size, hpz_group_size).process_groups(mesh)
        self.tensor_group, self.data_group = pgs.tensor, pgs.data
        self.shard_group, self.replicate_group, self.hpz_group = pgs.shard, pgs.replicate, pgs.hpz
        self.accumulating = False                     # a no_sync() backward ran since the last step
        self.mid_step = False          # a backward() ran, its step() not yet: checkpoints refuse
        # from here on the parameters are this engine's (owners.py: a second one is refused)
        self.owner = owners.Owner(self.owner_kind or f"a minizero stage-{self.stage} engine",
                                  self.composes_with)
        owners.claim(model.parameters(), self.owner,
                     {id(p): name for name, p in model.named_parameters()})
        # a model built by sharded_init holds only partitions: those are cast (construct.py), and
        # they hold rank 0's values already
        construct.cast_partitions(model, comm.device(), self.precision.compute)
        if self.replicate_group is not None:       # the core broadcasts within the shard group
            model.to(device=comm.device(), dtype=self.precision.compute)
            hierarchical.start_equal(model)
        # [Note: parameter groups] in optim.py: each group's settings, and {id(param): its group}
        parsed = None if param_groups is None else ParamGroups.parse(
            param_groups, list(model.named_parameters()))
        self.param_groups = None if parsed is None else parsed.settings
        self.group_of = None if parsed is None else parsed.group_of
        # where P_os lives, checkpointable (homes.py): the device, host memory or a file
        home = partial(DiskShardOptimizer, folder=offload_path) if offload == "disk" \
            else HostHome if offload else DeviceHome
        super().__init__(model, optimizer, dtype=dtype, reduce_dtype=reduce_dtype,
                         offload=offload, clip_grad_norm=clip_grad_norm, group=self.shard_group,
                         param_groups=parsed, home=home, **stage_options)
        # ZeRO-R: what forward saves (beyond/activations.py); model states: memory/meter.py
        self.activations = activations.SavedTensorMeter(self.params.param_tensors)
        self.meter = ModelStateMeter(self, self._tensors_by_category)
        # a plain loss.backward() is found from the model's output ([Note: loss.backward()])
        self._in_backward = False
        self.hooks = [model.register_forward_hook(self._forward_ends)]

    @classmethod
    def check(cls, dtype: str = "fp32", offload: bool | str = False,
              reduce_dtype: str | None = None, shard_group_size: int | None = None,
              hpz_group_size: int | None = None, world_size: int | None = None,
              offload_path: str | None = None) -> None:
        """Raise ValueError (one line) unless this stage's engine takes these policies (options.py:
        Precision, Offload, Sharding, at `world_size` ranks, default this process group's). The
        engine checks them when it is built; wrap.check, the CLI and the config reader call this
        before anything is built or any process started."""
        Precision(dtype, reduce_dtype)
        Offload(offload, offload_path).check(cls.row.number)
        Sharding(shard_group_size, hpz_group_size).check(cls.row.number, world_size)

    def keeps_gathered(self, unit) -> bool:
        """Whether a stage-3 unit stays gathered after its forward (FSDP's
        reshard_after_forward=False: fairscale/fsdp_engine.py); here never."""
        return False

    # --- forward and backward ---------------------------------------------------------------------
    def __call__(self, *inputs, **kwargs):
        with self.activations.recording():
            return self.module(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            loss = self.scaler.scale_loss(loss)         # every gradient S times larger (chain rule)
        self._in_backward = True                        # not a plain loss.backward(): see below
        super().backward(loss)
        self._in_backward = False

    def _enter_backward(self) -> None:
        self.accumulating |= not self.sync              # p.grad holds what no_sync() accumulated
        self.mid_step = True
        super()._enter_backward()

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

    # --- step -------------------------------------------------------------------------------------
    def averaged_gradients(self) -> list[torch.Tensor] | None:
        grads = super().averaged_gradients()
        if self.replicate_group is not None:       # HSDP: over the N/S groups too (hierarchical.py)
            hierarchical.average_across(grads, self.layout, self.replicate_group)
        if self.scaler is not None:                # fp16: the gradients are still S times too large
            grads = self.scaler.unscale(grads)     # fp32 / S; None: some rank overflowed, skip
        return grads

    def squared_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if self.tensor_group is not None:                  # [Note: the 2-D mesh]
            return tensor_parallel.squared_norm(self, grads)
        return super().squared_norm(grads)

    def step(self) -> None:
        super().step()
        self.accumulating = self.mid_step = False
        self.activations.new_step()

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
                                group=self.group, tag=f"bucket {b.index} masters")
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
    @property
    def _held(self):
        """Stage 3's hold on units for gathered() (absent.HeldForUser); stages 0-2: None, the
        parameters are there and a write stays this rank's own."""
        return getattr(self.params, "for_user", None)

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
        held = self._held
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
        held = self._held
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
        if self._held is not None:
            self._held.after_write(params)
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

    def _tensors_by_category(self) -> dict[str, list[torch.Tensor]]:
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


# Each stage's engine: the mixin over the stage's core engine, stage 3 with wrap's units and
# stages 2-3 with ZeRO++'s gradient route. stages.TABLE stays the paper's.
TABLE = {s: replace(row, parameters=ModelUnits if s == 3 else row.parameters,
                    gradients=quantize.Int8GradientShard if s >= 2 else row.gradients)
         for s, row in stages.TABLE.items()}


class DDP(Assembled, stages.DDP):
    row = TABLE[0]


class Zero1(Assembled, stages.Zero1):
    row = TABLE[1]


class Zero2(Assembled, stages.Zero2):
    row = TABLE[2]


class Zero3(Assembled, stages.Zero3):
    row = TABLE[3]

    @property
    def units(self) -> list:
        return self.params.units                  # zero3.ShardedUnits's, in forward order

    @property
    def unit_names(self) -> list[str]:
        return [unit.name for unit in self.params.units]       # by index, as in unit events


ENGINES = {0: DDP, 1: Zero1, 2: Zero2, 3: Zero3}
