"""The engine every stage shares: forward, backward, step, no_sync.

    engine = minizero.wrap(model, stage, functools.partial(torch.optim.AdamW, lr=1e-3))
    loss = loss_fn(engine(x), y)     # forward
    engine.backward(loss)            # backward + gradient communication
    engine.step()                    # clip, optimizer step on what this rank owns, share the result

An engine is built from one row of the ZeRO paper's table (stages.py): a *parameters* family (P_p),
a *gradients* family (P_g) and whether the optimizer is given this rank's partition (P_os).
__init__ builds them in that order, top to bottom; backward() and step() call each at its moment:

    backward   params.before_backward -> loss.backward() [the reducer, per complete bucket b:
               params.bucket_ready(b, grads.reduce)] -> reducer.finish -> params.after_backward
    step       grads.parts() -> clip -> optimizer.step -> params.after_step -> grads.zero()

The model computes in `dtype` ("fp32", "bf16" or "fp16"), the optimizer keeps fp32 masters
(optim.py). This is the paper's engine; what users get is it with what they need around it and
what came after the paper, composed in assembled.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from minizero import comm, events
from minizero.flat import DEFAULT_BUCKET_BYTES
from minizero.offload import optimizer_home
from minizero.optim import DTYPES, Placement
from minizero.reducer import GradBuckets


@dataclass(frozen=True)
class StageOptions:
    """The options the families read, with their defaults (which stage takes which: options.py)."""
    bucket_size: float = DEFAULT_BUCKET_BYTES   # bytes per gradient bucket (stages 0, 2; flat.py)
    buckets_in_flight: int = 2                  # reducer.py: buckets whose collective may be open
    overlap: bool = True                        # stage 0: False sends every bucket after backward
    units: list | None = None     # stage 3: (module, its parameters) per unit (None: the model)
    prefetch: bool = True                       # stage 3: gather the next unit during this one


class Engine:
    """Built from `row`, a stages.Stage: each stage's engine class (stages.py) sets it."""
    row = None
    options_class = StageOptions      # what its families read (assembled.py's has more)

    def __init__(self, model: nn.Module, optimizer, *, dtype: str = "fp32",
                 reduce_dtype: str | None = None, offload: bool | str = False,
                 clip_grad_norm: float | None = None, group: comm.Group | None = None,
                 param_groups=None, home=None, **stage_options):
        """optimizer: a factory params -> torch.optim.Optimizer. group: the ranks ZeRO partitions
        over (None: all N). param_groups: param_groups.ParamGroups or None. home: where P_os lives,
        (parts, optimizer, grouping) -> the optimizer (None: offload.optimizer_home)."""
        self.module, self.optimizer_factory = model, optimizer
        self.options = self.options_class(**stage_options)
        self.dtype, self.grad_dtype = DTYPES[dtype], DTYPES[reduce_dtype or dtype]
        self.offload, self.clip_grad_norm, self.group = offload, clip_grad_norm, group
        self.rank, self.world_size, self.device = comm.rank(), comm.world_size(), comm.device()
        self.sync = True                              # False inside no_sync()
        self.last_grad_norm: float | None = None
        self.step_count = 0                           # steps taken (a checkpoint saves it)

        # every rank starts from rank 0's weights and buffers, in the compute dtype
        model.to(device=self.device, dtype=self.dtype)
        self._broadcast_from_rank0()
        self.model_params = list(model.parameters())  # distinct: a tied weight appears once
        self.trainable = [p for p in self.model_params if p.requires_grad]
        self.frozen = [p for p in self.model_params if not p.requires_grad]   # never stepped

        # The stage's row of the table (stages.py), family by family.
        # P_p: where the parameters live, and the flat layout of their buckets (flat.py)
        buckets = self.row.buckets(self.trainable, self.options.bucket_size) \
            if self.row.buckets else None                   # stage 3: each unit is a bucket
        self.params = self.row.parameters(self, buckets, self.options)
        self.layout = self.params.layout
        # P_g: where the gradients live, and how a complete bucket is reduced
        self.grads = self.row.gradients(self, self.layout, self.options)
        self.reducer = GradBuckets(
            self.layout.buckets, launch=self._bucket_ready, done=self.grads.arrived,
            on_grad=self.grads.on_grad, max_in_flight=self.options.buckets_in_flight,
            overlap=self.options.overlap, owner=self) if self.grads.in_backward else None
        # P_os: the optimizer gets what this rank steps, Ψ/N (stages 1-3) or Ψ (DDP), in the
        # row's home if it has one (FSDP's, Muon's), else here: the device or the host
        home = self.row.optimizer or home or optimizer_home(offload)
        buckets = self.layout.buckets                       # where each part sits: its partition
        placement = Placement(buckets, [self.layout.rank * b.shard_numel if self.sharded else 0
                                        for b in buckets], self.group)
        grouping = None if param_groups is None else param_groups.grouping(self)
        # <- the essential line of P_os: it is handed Ψ/N parameters (homes.py)
        self.optimizer = home(self.params.optimizer_parts(), optimizer, grouping, placement)

    @property
    def stage(self) -> int:
        return self.row.number

    @property
    def sharded(self) -> bool:                    # stages 1-3: the optimizer steps a partition
        return self.row.partitioned

    def _broadcast_from_rank0(self) -> None:
        src = 0 if self.group is None else self.group.ranks[0]
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                # (a parameter built partitioned has no values here to send: construct.py)
                if t.untyped_storage().nbytes() >= t.numel() * t.element_size():
                    comm.broadcast(t.data, src=src, group=self.group,
                                   tag="rank 0's initial values")

    # --- forward ----------------------------------------------------------------------------------
    def __call__(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    # --- backward ---------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        self._enter_backward()
        loss.backward()            # autograd's hooks hand each complete bucket to the reducer
        self.end_backward()
        events.emit("backward done", engine=self)

    def _enter_backward(self) -> None:
        self.params.before_backward()

    def _bucket_ready(self, b):
        """The reducer: b's gradients are complete. Parameters first (stage 3: the unit's
        post-backward), which hand b to the gradients' reduce."""
        return self.params.bucket_ready(b, self.grads.reduce)

    def end_backward(self) -> None:
        """Launch the buckets not launched yet (unused parameters: zeros), wait for all; stage 3
        frees its units."""
        if self.reducer is not None:
            self.reducer.finish()
        self.params.after_backward()

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward inside the block only accumulates locally; the first
        backward outside it reduces the sum of the micro-batches."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    # --- step -------------------------------------------------------------------------------------
    def step(self) -> None:
        grads = self.averaged_gradients()
        if grads is not None:
            if self.clip_grad_norm is not None:
                self.last_grad_norm = self._clip(grads)
            self.optimizer.step(grads)
            events.emit("optimizer step", engine=self)
            self.params.after_step()             # stages 1-2: all-gather the updated partitions
            events.emit("step", engine=self)
        self.grads.zero()
        self.step_count += 1

    def averaged_gradients(self) -> list[torch.Tensor] | None:
        """What the optimizer steps: each bucket's gradient averaged over the ranks, this rank's
        partition (stages 1-3) or all (DDP); stage 1 reduce-scatters here. (None would skip the
        step: fp16's overflow, assembled.py.)"""
        return self.grads.parts()

    def _clip(self, grads: list[torch.Tensor]) -> float:
        """Clip by the *global* norm, torch.nn.utils.clip_grad_norm_'s formula. Clipping each shard
        by its own norm (a classic mistake) would give every rank a different scale."""
        norm = self.squared_norm(grads).sqrt()
        scale = (self.clip_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
        return norm.item()

    def squared_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """‖g‖² of the whole model: a rank holding partitions sums its squares, then the ranks'."""
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in grads:
            squares += g.float().pow(2).sum()
        if self.sharded:
            comm.all_reduce(squares, op="sum", group=self.group, tag="gradient norm")
        return squares
