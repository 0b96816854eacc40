"""`minizero.FullyShardedDataParallel`: FairScale's front end to stage 3. Wrap the model, bring your
optimizer.

    model = minizero.FullyShardedDataParallel(model)     # in a process group (launch / torchrun)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # this rank's flat shards
    loss = loss_fn(model(x), y)
    loss.backward()                                      # each shard's .grad: its averaged gradient
    optimizer.step(); optimizer.zero_grad()

Run its tests:  python -m pytest tests/test_fsdp.py

Two front ends, one engine. `minizero.wrap(model, 3, optimizer_factory)` owns the optimizer: it
builds it over this rank's partition and steps it in engine.step(). FairScale's FSDP gives the
optimizer to the user, so the wrapper must hand out parameters the user's optimizer can step: the
partitions themselves. Everything else is stage 3 as zero3.py tells it (same Zero3 engine, same
units, same hooks):
  * parameters(): one nn.Parameter per unit, FairScale's FlatParameter: this rank's partition of the
    unit's flattened parameters [Ψ_u / N], sharing storage with the engine's param_shard. An
    optimizer step on them is a step on the shard the next gather reads. The model's own parameters
    stay views of the units' full buffers (freed between uses) and are not the wrapper's parameters.
  * loss.backward(): no engine.backward() to call, so the wrapper finds backward's start and end
    itself: a hook on the model's output (its gradient is the first thing backward computes) and a
    callback queued on autograd's engine for when backward is done (FSDP does the same). At the end
    the reduce-scatters are finished and each FlatParameter's .grad is its part of the gradient
    shard, averaged over the N ranks. No zero_grad(): the next backward adds to it, as autograd
    does.
  * reshard_after_forward=True frees each unit after its forward (stage 3); False keeps it gathered
    from its forward to its backward (stage 2's parameter memory during the step, Ψ/N between
    steps).
  * mixed_precision=True (FairScale's flag): the model computes in bf16 and its gradients are
    reduced in fp32 (reduce_dtype="fp32", engine.py); the FlatParameters are then fp32 *masters* of
    the bf16 partitions (optim.py's accounting: 2 + 4 + 12 bytes a parameter for Adam), and the
    user's optimizer.step() updates those. The bf16 partitions are refreshed from them when the
    next forward starts, the one moment every step passes through before the parameters are read.
  * Clip with model.clip_grad_norm_(max): the norm over all N partitions.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from minizero.zero3 import IDLE, PRE_BACKWARD, Unit, Zero3


class FlatParameters:
    """What sits in the engine's optimizer slot: the FlatParameters the user's optimizer steps, one
    per partition handed to _make_optimizer (one per unit that trains). In fp32 they share storage
    with the partitions (no copy); with bf16 partitions they are fp32 masters of them, copied into
    the partitions by refresh(). The optimizer's state is the user's."""

    def __init__(self, parts: list[torch.Tensor]):
        self.param_parts = parts
        self.params = [nn.Parameter(part if part.dtype == torch.float32 else part.float())
                       for part in parts]            # fp32: views of param_shard; else [Ψ_u/N] fp32

    def _masters(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(master, its partition) where they are separate tensors (bf16 partitions)."""
        return [(p, part) for p, part in zip(self.params, self.param_parts)
                if p.data_ptr() != part.data_ptr()]

    def refresh(self) -> None:
        """The partitions take the masters' values, rounded (what ShardOptimizer.step does)."""
        with torch.no_grad():
            for master, part in self._masters():
                part.copy_(master)

    def reload(self) -> None:
        """The partitions were written (load_state_dict): the masters take their values."""
        with torch.no_grad():
            for master, part in self._masters():
                master.copy_(part)

    def master_values(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.params]

    def device_tensors(self) -> list[torch.Tensor]:
        return [master for master, _ in self._masters()]       # the 4 of 2 + 4 + K

    def host_tensors(self) -> list[torch.Tensor]:
        return []

    def disk_bytes(self) -> int:
        return 0                                  # the user's optimizer keeps its state in memory


class KeptUnit(Unit):
    """A unit that, with reshard_after_forward=False, stays gathered from its forward to its
    backward."""

    def post_forward(self) -> None:
        if self.engine.reshard_after_forward:
            super().post_forward()
        elif self.training_state != PRE_BACKWARD:
            self.training_state = IDLE


class FSDPEngine(Zero3):
    """Stage 3 whose optimizer is the user's: backward is driven by autograd alone (see the module's
    top)."""
    unit_class = KeptUnit

    def __init__(self, module: nn.Module, reshard_after_forward: bool = True, **options):
        self.reshard_after_forward = reshard_after_forward
        self._in_backward = False
        super().__init__(module, FlatParameters, **options)   # the "optimizer" the engine builds

    def _on_pre_forward(self, unit, module, args) -> None:
        if unit.module is self.module and unit.training_state != PRE_BACKWARD:   # a step's forward
            self.optimizer.refresh()          # bf16 partitions from the masters the user stepped
        super()._on_pre_forward(unit, module, args)

    def _make_optimizer(self, parts):
        return self.optimizer_factory(parts)       # FlatParameters: the user's optimizer steps them

    def _grad_of(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(FlatParameter, its part of the gradient shard), bucket by bucket."""
        return [(p, self.layout.shard(self.grad_shard, b))
                for p, b in zip(self.optimizer.params, self.layout.buckets)]

    def _on_post_forward(self, unit, module, args, output) -> None:
        # the model's output: its gradient is where backward starts
        if unit.module is self.module and torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self._backward_starts)
        super()._on_post_forward(unit, module, args, output)

    def _backward_starts(self, grad: torch.Tensor) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        for unit in self.units:                       # a forward from here on is a recompute
            unit.training_state = PRE_BACKWARD        # [Note: recompute] (zero3.py)
        for p, part in self._grad_of():
            if p.grad is None:
                part.zero_()                # zero_grad(set_to_none=True) since the last backward
            elif p.grad.data_ptr() != part.data_ptr():
                part.copy_(p.grad)                    # a gradient the user set: accumulate onto it
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)

    def _backward_ends(self) -> None:
        self._in_backward = False
        self._after_backward()             # Zero3's: finish the reduce-scatters, free the units
        for p, part in self._grad_of():
            p.grad = part                             # this rank's averaged gradient, added into
        self._track_peak()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every FlatParameter's .grad so that the global norm (over all N partitions) is at
        most max_norm; returns the norm before clipping (torch.nn.utils.clip_grad_norm_ on the whole
        model)."""
        self.clip_grad_norm = max_norm
        grads = [p.grad for p in self.optimizer.params if p.grad is not None]
        return torch.tensor(self._clip(grads))


class FullyShardedDataParallel(nn.Module):
    """model = FullyShardedDataParallel(model, reshard_after_forward=True, mixed_precision=False,
    units=None, prefetch=True).

    units: the submodules gathered together (FairScale's nested FSDP / auto_wrap_policy; default:
    minizero.units.default_units, a transformer's blocks). Collective: every rank builds it."""

    def __init__(self, module: nn.Module, reshard_after_forward: bool = True, *,
                 mixed_precision: bool = False, units: list[nn.Module] | None = None,
                 prefetch: bool = True):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(reshard_after_forward, bool):
            raise TypeError("reshard_after_forward must be True or False, got "
                            f"{reshard_after_forward!r}")
        if not isinstance(mixed_precision, bool):
            raise TypeError(f"mixed_precision must be True or False, got {mixed_precision!r}")
        precision = {"dtype": "bf16", "reduce_dtype": "fp32"} if mixed_precision else {}
        self.engine = FSDPEngine(module, reshard_after_forward, units=units, prefetch=prefetch,
                                 **precision)
        # all that parameters() yields
        self.flat_params = nn.ParameterList(self.engine.optimizer.params)

    @property
    def module(self) -> nn.Module:
        """The wrapped model (not a registered child: its parameters are views of freed unit
        buffers)."""
        return self.engine.module

    def forward(self, *inputs, **kwargs):
        return self.engine(*inputs, **kwargs)

    def train(self, mode: bool = True):
        self.module.train(mode)
        return super().train(mode)

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The model's full state (its own keys, CPU, fp32) on every rank. Collective."""
        return self.engine.full_state_dict()

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a full state dict (the model's keys); rank 0's is what every rank gets.
        Collective."""
        with self.engine.gathered(modifier_rank=0):
            return self.module.load_state_dict(state_dict, strict=strict)

    def summon_full_params(self):
        """Inside the block the model's full parameters are readable on every rank
        (engine.gathered)."""
        return self.engine.gathered()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self.engine.clip_grad_norm_(max_norm)
