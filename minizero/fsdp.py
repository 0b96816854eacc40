"""`minizero.FullyShardedDataParallel`: FairScale's FSDP on stage 3. Wrap the model, bring your
optimizer.

    model = minizero.FullyShardedDataParallel(model)     # in a process group (launch / torchrun)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # this rank's flat shards
    loss = loss_fn(model(x), y)
    loss.backward()                                      # each shard's .grad: its averaged gradient
    optimizer.step(); optimizer.zero_grad()

Run its tests:  python -m pytest tests/test_fsdp.py tests/test_fairscale_scenarios.py

Two front ends, one engine. `minizero.wrap(model, 3, optimizer_factory)` owns the optimizer: it
builds it over this rank's partition and steps it in engine.step(). FairScale's FSDP gives the
optimizer to the user, so the wrapper must hand out parameters the user's optimizer can step: the
partitions themselves. Everything else is stage 3 as zero3.py tells it (same Zero3 engine, same
units, same hooks):
  * parameters(): one nn.Parameter per unit, FairScale's FlatParameter: this rank's partition of the
    unit's flattened parameters [Ψ_u / N], sharing storage with the engine's param_shard. An
    optimizer step on them is a step on the shard the next gather reads. The model's own parameters
    stay views of the units' full buffers (freed between uses) and are not the wrapper's parameters.
  * Units, FairScale's way: an FSDP inside the model (FairScale's nesting, or fsdp_wrap.py's
    wrap / auto_wrap) is a unit. The outermost FSDP adopts the inner ones when it is built: each
    gives back its full parameters and its engine, and becomes a unit of the outer engine (one
    engine, one FlatParameter per instance that trains). Without inner FSDPs the units are
    minizero.units.default_units (a transformer's blocks), or `units=`.
  * loss.backward(): no engine.backward() to call, so the wrapper finds backward's start and end
    itself: a hook on the model's output (its gradient is the first thing backward computes) and a
    callback queued on autograd's engine for when backward is done (FSDP does the same). Both hang
    on the model itself, a unit or not (an nn.Sequential owns no parameter). At the end the
    reduce-scatters are finished and each FlatParameter's .grad holds its part of the gradient
    shard, averaged over the N ranks, added to what .grad held (no zero_grad(): accumulation).
  * reshard_after_forward=True frees each unit after its forward (stage 3); False keeps it gathered
    from its forward to its backward (stage 2's parameter memory during the step, Ψ/N between
    steps). disable_reshard_on_root=True (FairScale's default) keeps the root's own unit so.
  * mixed_precision=True (FairScale's flag): the model computes in compute_dtype (default fp16),
    floating inputs are cast to it, gradients are reduced in it (fp32_reduce_scatter=True: in
    fp32); the FlatParameters are fp32 *masters* of the 16-bit partitions, taken from the model's
    fp32 values, and the user's optimizer.step() updates those. The partitions are refreshed from
    them when the next forward starts, the one moment every step passes through before the
    parameters are read. No loss scaling (FairScale leaves that to ShardedGradScaler).
  * Clip with model.clip_grad_norm_(max_norm, norm_type): the norm over all N partitions.
Checkpoints and summon_full_params: fsdp_state.py. FairScale's other keywords: fsdp_options.py.
"""

from __future__ import annotations

import contextlib
import math
from functools import partial
import warnings
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from minizero import comm, engine as engine_module
from minizero.fsdp_options import resolve
from minizero.fsdp_state import StateMixin, clean
from minizero.zero3 import IDLE, PRE_BACKWARD, Unit, Zero3


class FlatParameters:
    """What sits in the engine's optimizer slot: the FlatParameters the user's optimizer steps, one
    per partition handed to _make_optimizer (one per unit that trains). In fp32 they share storage
    with the partitions (no copy); with 16-bit partitions they are fp32 masters of them, copied into
    the partitions by refresh(). The optimizer's state is the user's."""

    def __init__(self, parts: list[torch.Tensor], masters: bool = True):
        self.param_parts = parts          # masters=False: FairScale's pure 16-bit mode, no copies
        self.params = [nn.Parameter(part if part.dtype == torch.float32 or not masters
                                    else part.float())
                       for part in parts]            # fp32: views of param_shard; else [Ψ_u/N] fp32

    def _masters(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(master, its partition) where they are separate tensors (16-bit partitions)."""
        return [(p, part) for p, part in zip(self.params, self.param_parts)
                if p.data_ptr() != part.data_ptr()]

    def refresh(self) -> None:
        """The partitions take the masters' values, rounded (what ShardOptimizer.step does)."""
        with torch.no_grad():
            for master, part in self._masters():
                part.copy_(master)

    def reload(self) -> None:
        """The partitions were written (load_state_dict, summon_full_params): the masters take the
        values that changed; an element written with its own value keeps its fp32 master."""
        with torch.no_grad():
            for master, part in self._masters():
                changed = master.to(part.dtype) != part
                master[changed] = part[changed].float()

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
    backward (a forward without autograd frees it anyway: no backward will)."""

    def post_forward(self) -> None:
        if not self.engine.keeps(self) or not torch.is_grad_enabled():
            super().post_forward()
        elif self.training_state != PRE_BACKWARD:
            self.training_state = IDLE


class FSDPEngine(Zero3):
    """Stage 3 whose optimizer is the user's: backward is driven by autograd alone (see the module's
    top)."""
    unit_class = KeptUnit

    def __init__(self, module: nn.Module, kept: dict[int, bool], keep_others: bool,
                 masters: bool, **options):
        # id(unit module) -> it stays gathered from forward to backward (inner FSDPs, the root);
        # the other units (default_units, units=): keep_others
        self.kept, self.keep_others = kept, keep_others
        self._in_backward = False
        fp32 = {}                       # mixed precision: rank 0's fp32 values, for the masters
        if masters and options["dtype"] != "fp32":
            fp32 = {id(p): p.data for p in module.parameters() if p.requires_grad}
            for value in fp32.values():
                comm.broadcast(value, src=0, tag="rank 0's fp32 values")
        # the "optimizer" the engine builds
        super().__init__(module, partial(FlatParameters, masters=masters), **options)
        if fp32:
            self._take_masters(fp32)
        self.retired = False
        for p in module.parameters():
            p._fsdp_owner = weakref.ref(self)      # the FSDP engine holding it (_borrowed)
        # where a step starts and where backward starts: the model's, a unit or not
        self.hooks += [module.register_forward_pre_hook(self._step_starts, prepend=True),
                       module.register_forward_hook(self._forward_ends)]

    def _take_masters(self, fp32: dict[int, torch.Tensor]) -> None:
        """16-bit partitions: the fp32 masters start from the model's fp32 values, not from their
        rounding (FairScale's fp32 shards)."""
        for p, b in zip(self.optimizer.params, self.layout.buckets):
            if p.data_ptr() != self.layout.shard(self.param_shard, b).data_ptr():
                full = torch.zeros(b.padded_numel, dtype=torch.float32, device=self.device)
                for param, view in b.views(full):
                    view.copy_(fp32[id(param)])
                p.data.copy_(self.layout.my_partition(full, b))

    def keeps(self, unit: Unit) -> bool:
        return self.kept.get(id(unit.module), self.keep_others)

    def retire(self) -> dict[str, torch.Tensor]:
        """Hand the model over (to an outer FSDP): its full state (fp32 masters), every hook of
        this engine removed. Collective."""
        state = self.full_state_dict()
        self.retired = True
        for handle in self.hooks + self.reducer.hooks:     # forward hooks, gradient hooks
            handle.remove()
        engine_module._WRAPPED.discard(self.module)
        return state

    def _step_starts(self, module, args) -> None:
        if not self._in_backward:                 # not a recompute ([Note: recompute], zero3.py)
            self.optimizer.refresh()       # 16-bit partitions from the masters the user stepped

    def _make_optimizer(self, parts):
        return self.optimizer_factory(parts)       # FlatParameters: the user's optimizer steps them

    def _grad_of(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(FlatParameter, its part of the gradient shard), bucket by bucket."""
        return [(p, self.layout.shard(self.grad_shard, b))
                for p, b in zip(self.optimizer.params, self.layout.buckets)]

    def _forward_ends(self, module, args, output) -> None:
        # the model's output: its gradient is where backward starts
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self._backward_starts)

    def _backward_starts(self, grad: torch.Tensor) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        for unit in self.units:                       # a forward from here on is a recompute
            unit.training_state = PRE_BACKWARD        # [Note: recompute] (zero3.py)
        for p, part in self._grad_of():
            if p.grad is None or p.grad.data_ptr() != part.data_ptr():
                part.zero_()     # the reduce-scatters add into it; _backward_ends adds it to .grad
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)

    def _backward_ends(self) -> None:
        self._in_backward = False
        self._after_backward()             # Zero3's: finish the reduce-scatters, free the units
        for p, part in self._grad_of():
            if p.grad is None:             # fp32: the shard itself, accumulated into in place
                p.grad = part if part.dtype == p.dtype else part.float()
            elif p.grad.data_ptr() != part.data_ptr():
                p.grad.add_(part)          # a .grad the user set, or fp32 over 16-bit reductions
        self._track_peak()

    def _extra_tensors(self, category):
        extra = super()._extra_tensors(category)
        if category == "grads":       # fp32 .grad over 16-bit reductions: tensors of their own
            extra = extra + [p.grad for p in self.optimizer.params]
        return extra

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every FlatParameter's .grad so that the global p-norm (over all N partitions) is at
        most max_norm; returns the norm before clipping (torch.nn.utils.clip_grad_norm_ on the whole
        model). Padding is zero: it adds nothing to any norm."""
        norm_type = float(norm_type)
        grads = [p.grad for p in self.optimizer.params if p.grad is not None]
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if norm_type == math.inf:                      # the largest |g| on any rank
            for g in grads:
                total = torch.maximum(total, g.detach().float().abs().max())
            comm.all_reduce(total, op="max", group=self.shard_group, tag="gradient norm")
        else:                                          # (Σ over ranks of Σ |g|^p)^(1/p)
            for g in grads:
                total += g.detach().float().abs().pow(norm_type).sum()
            comm.all_reduce(total, op="sum", group=self.shard_group, tag="gradient norm")
            total = total ** (1.0 / norm_type)
        scale = max_norm / (total + 1e-6)
        if scale < 1:
            for g in grads:
                g.detach().mul_(scale.to(g.dtype))
        return total


class FullyShardedDataParallel(StateMixin, nn.Module):
    """FairScale 0.4.13's FullyShardedDataParallel(module, process_group=None, ...): its arguments,
    in its order (fsdp_options.py says which take effect and how), and two of minizero's:
    units (the submodules gathered together, besides inner FSDPs; default:
    minizero.units.default_units when there are none) and prefetch. Collective: every rank builds
    it."""

    def __init__(self, module: nn.Module, process_group=None, process_group_reduce_scatter=None,
                 reshard_after_forward: bool = True, disable_reshard_on_root: bool = True,
                 mixed_precision: bool = False, fp32_reduce_scatter: bool = False,
                 flatten_parameters: bool = True, move_params_to_cpu: bool = False,
                 compute_dtype: torch.dtype | None = None, buffer_dtype: torch.dtype | None = None,
                 move_grads_to_cpu: bool | None = None, bucket_cap_mb: int = 25,
                 compute_device=None, no_broadcast_optim_state: bool = False,
                 state_dict_device=None, clear_autocast_cache: bool = False,
                 force_input_to_fp32: bool = False, verbose: bool = False,
                 cpu_offload: bool = False, state_dict_on_rank_0_only: bool = False,
                 gradient_predivide_factor: float | None = None,
                 allow_reset_parameters: bool = False, *,
                 units: list[nn.Module] | None = None, prefetch: bool = True):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        options = {k: v for k, v in locals().items() if k not in ("self", "module", "units",
                                                                    "prefetch", "__class__")}
        self.settings = resolve(**options)            # fsdp_options.Settings: checked, one line
        self.settings.check_pure(module)
        handed_over = _take_over(module, self.settings)
        for fsdp in _instances(module):          # the outermost inner ones: each adopted its own
            fsdp._become_unit(self.settings)
        inner = _instances(module)                      # now those at every depth
        kept = {id(m): not m.settings.reshard_after_forward for m in inner}
        kept[id(module)] = not reshard_after_forward or disable_reshard_on_root
        chosen = None if units is None and not inner else [*(units or []), *inner]
        with warnings.catch_warnings(), _borrowed(module):
            if inner and units is None:       # nesting chose the units: FairScale's, not advice's
                warnings.filterwarnings("ignore", message="stage 3: unit")
            self.engine = FSDPEngine(module, kept, not reshard_after_forward,
                                     self.settings.masters, units=chosen, prefetch=prefetch,
                                     **self.settings.engine_options)
        self.engine.wrapper = weakref.ref(self)
        for fsdp in inner + handed_over:
            fsdp._outer_engine = self.engine            # what runs it (fsdp_state.py)
        self._summoned = False                          # inside summon_full_params()
        # all that parameters() yields
        self.flat_params = nn.ParameterList(self.engine.optimizer.params)

    def _become_unit(self, outer) -> None:
        """An outer FSDP adopts this one: its full parameters come back into its module (fp32, from
        the masters), its engine is retired, and the module becomes a registered child: a unit of
        the outer engine, reached through this wrapper. Collective."""
        if self.engine is None:                        # adopted before (nested twice)
            return
        if (self.settings.dtype, self.settings.reduce_dtype) != (outer.dtype, outer.reduce_dtype):
            warnings.warn("FullyShardedDataParallel: an inner instance's mixed_precision / "
                          "compute_dtype / fp32_reduce_scatter give way to the outer one's (one "
                          "engine runs them all)", stacklevel=3)
        module, state = self.engine.module, self.engine.retire()
        with torch.no_grad():
            for name, t in [*module.named_parameters(), *module.named_buffers()]:
                t.data = state[name].to(t.device)
        self.engine, self.flat_params = None, nn.ParameterList()
        self._fsdp_wrapped_module = module

    @property
    def module(self) -> nn.Module:
        """The wrapped model (of the root: not a registered child, its parameters are views of
        freed unit buffers; of an adopted instance: its registered child)."""
        return self.engine.module if self.engine is not None else self._fsdp_wrapped_module

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:                         # FairScale: the wrapped module's attributes
            if name.startswith("_") or name in ("engine", "settings", "module"):
                raise
            return getattr(self.module, name)

    def __getitem__(self, key):
        return self.module[key]                        # FairScale: an nn.Sequential's indexing

    def forward(self, *inputs, **kwargs):
        dtype = self.settings.input_dtype(root=self.engine is not None)
        if dtype is not None:             # the root's 16-bit cast cuts the graph, as FairScale's
            detach = dtype != torch.float32
            inputs, kwargs = tree_map(lambda t: _cast(t, dtype, detach), (inputs, kwargs))
        if self.engine is None:
            return self._fsdp_wrapped_module(*inputs, **kwargs)   # the outer engine's unit hooks
        return self.engine(*inputs, **kwargs)

    def apply(self, fn):
        """FairScale's: fn on every module (the wrapped model's too) with the full parameters
        summoned, so an initialisation written inside persists. Collective."""
        with self.summon_full_params():
            if self.engine is not None:
                self.module.apply(fn)                  # the root's model: not a registered child
            super().apply(fn)
        return self

    def _apply(self, fn, recurse: bool = True):
        """model.to() / .half() / .cuda() after wrapping: a no-op where nothing changes; a cast or a
        move would cut the FlatParameters from the shards the engine reads, so it is refused."""
        if self.engine is None:                        # adopted: the outer engine casts its module
            return super()._apply(fn, recurse)
        for p in self.flat_params:
            moved = fn(p.data)
            if (moved.dtype, moved.device) != (p.dtype, p.device):
                raise ValueError("move or cast the model before wrapping it: "
                                 "FullyShardedDataParallel computes on this rank's device in its "
                                 "compute_dtype")
        return self

    def train(self, mode: bool = True):
        if self.engine is not None:
            self.module.train(mode)
        return super().train(mode)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        """Outside summon_full_params(): flat_params.i, the FlatParameters. Inside it (and for an
        adopted instance): the model's parameters under their own names."""
        if self._summoned and self.engine is not None:       # the root's module: not a child
            named = self.module.named_parameters(prefix, recurse, remove_duplicate)
        else:
            named = super().named_parameters(prefix, recurse, remove_duplicate)
        for name, p in named:
            yield (clean(name), p) if self._summoned or self.engine is None else (name, p)

    @contextlib.contextmanager
    def no_sync(self):
        """FairScale's gradient accumulation without communication: backward inside only adds into
        the model's full p.grad (2Ψ/N more... Ψ of gradient memory); the first backward outside
        reduce-scatters the sum. Root only, between steps."""
        if self.engine is None:
            raise RuntimeError("no_sync() on an inner FSDP: call it on the outermost one")
        with self.engine.no_sync():
            yield

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model (norm_type 2, any p, or inf); the
        total norm before clipping. Root only; collective."""
        if self.engine is None:
            raise RuntimeError("clip_grad_norm_ on an inner FSDP: call it on the outermost one")
        if not float(norm_type) > 0:
            raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
        return self.engine.clip_grad_norm_(float(max_norm), norm_type)

    def extra_repr(self) -> str:
        return self.settings.describe() if self.settings.verbose else ""


def _take_over(module: nn.Module, settings) -> list[FullyShardedDataParallel]:
    """FairScale's wrapping again (a model wrapped, trained, then wrapped anew for inference): the
    FSDP that had the module (or one inside it) hands it over, as an inner one does
    (_become_unit); that wrapper then runs through this one's engine."""
    owners = {p._fsdp_owner() for p in module.parameters() if hasattr(p, "_fsdp_owner")}
    handed_over = [owner.wrapper() for owner in owners
                   if owner is not None and not owner.retired
                   and any(m is owner.module for m in module.modules())]
    for wrapper in handed_over:
        wrapper._become_unit(settings)
    return handed_over


@contextlib.contextmanager
def _borrowed(module: nn.Module):
    """Inside, the module's parameters that another FSDP holds (a weight shared with a module that
    FSDP wrapped before: FairScale's shared weights across instances) are gathered by it: this
    engine takes their values (until an outer FSDP adopts both, each holds its own partitions)."""
    lent: dict[FSDPEngine, list[nn.Parameter]] = {}
    for p in module.parameters():
        owner = p._fsdp_owner() if hasattr(p, "_fsdp_owner") else None
        if owner is not None and not owner.retired:
            lent.setdefault(owner, []).append(p)
    with contextlib.ExitStack() as stack:
        for owner, params in lent.items():
            stack.enter_context(owner.gathering(params))
        yield


def _instances(module: nn.Module) -> list[FullyShardedDataParallel]:
    return [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]


def _cast(t, dtype: torch.dtype, detach: bool):
    """FairScale's input cast: a floating tensor to dtype (detach: outside autograd, a leaf keeping
    its requires_grad)."""
    if not torch.is_tensor(t) or not t.is_floating_point() or t.dtype == dtype:
        return t
    if not detach:
        return t.to(dtype)
    with torch.no_grad():
        cast = t.to(dtype)
    return cast.requires_grad_(t.requires_grad) if t.is_leaf else cast
