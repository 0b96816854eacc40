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
optimizer to the user, so the wrapper hands out parameters the user's optimizer can step: the
partitions themselves, one FlatParameter per unit. Everything else is stage 3 as zero3.py tells it
(same units, same hooks); fairscale/fsdp_engine.py is what FairScale's way changes (backward driven
by autograd alone, fp32 masters, clipping).

Units, FairScale's way: an FSDP inside the model (FairScale's nesting, or fairscale/fsdp_wrap.py's
wrap / auto_wrap) is a unit. The outermost FSDP adopts the inner ones when it is built: each gives
back its full parameters and retires its engine, and its module becomes a unit of the outer engine
(one engine, one FlatParameter per instance that trains), reached through the inner wrapper. Without
inner FSDPs the units are minizero.units.default_units (a transformer's blocks), or `units=`.
Wrapping a wrapped model again hands it over the same way; a weight shared with a module another
FSDP wrapped is borrowed from it.

Checkpoints and summon_full_params: fairscale/fsdp_state.py. FairScale's constructor keywords:
fairscale/fsdp_options.py (implemented, warned where they change only speed, or refused in one
line).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from minizero import comm
from minizero.fairscale.fsdp_engine import FSDPEngine
from minizero.fairscale.fsdp_options import resolve
from minizero.fairscale.fsdp_state import StateMixin, clean


class FullyShardedDataParallel(StateMixin, nn.Module):
    """FairScale 0.4.13's FullyShardedDataParallel(module, process_group=None, ...): its arguments,
    in its order (fairscale/fsdp_options.py says which take effect and how), and two of minizero's:
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
                                     self.settings.masters, self.settings.fp32_buffers,
                                     units=chosen, prefetch=prefetch,
                                     **self.settings.engine_options)
        self.engine.wrapper = weakref.ref(self)
        for fsdp in inner + handed_over:
            fsdp._outer_engine = self.engine            # what runs it (fairscale/fsdp_state.py)
        self._summoned = False                          # inside summon_full_params()
        for i, p in enumerate(self.engine.optimizer.params):      # all that parameters() yields
            self.register_parameter(f"flat_param_{i}", p)           # FairScale's names
        # FairScale's attributes, as its users read them
        self.mixed_precision, self.compute_dtype = mixed_precision, self.settings.torch_dtype
        self.reshard_after_forward = reshard_after_forward
        self.flatten_parameters, self.allow_reset_parameters = True, allow_reset_parameters
        self.rank, self.world_size = comm.rank(), comm.world_size()
        self.process_group = process_group or dist.group.WORLD

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
        module, self.engine = _hand_back(self.engine), None
        self._parameters.clear()                        # its FlatParameters: the outer's now
        self._fsdp_wrapped_module = module

    @property
    def flat_params(self) -> list[nn.Parameter]:
        """The FlatParameters, flat_param_i: this rank's partition of each unit that trains."""
        return list(self._parameters.values())

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

    def modules(self):
        """FairScale's: the wrapper, then the wrapped model's modules, inner FSDP instances among
        them (the root's model is not a registered child; named_modules() stays the wrapper's)."""
        if self.engine is None:
            yield from super().modules()
        else:
            yield self
            yield from self.module.modules()

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
        """Outside summon_full_params(): flat_param_i, the FlatParameters. Inside it (and for an
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
        the model's full p.grad (Ψ of gradient memory, as FairScale's); the first backward outside
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

    def reset_parameters(self) -> None:
        """FairScale's allow_reset_parameters=True: the module's reset_parameters(), on its full
        parameters (summoned; what it writes persists). Collective."""
        if not self.allow_reset_parameters:
            raise RuntimeError("reset_parameters() needs FullyShardedDataParallel(..., "
                               "allow_reset_parameters=True)")
        with self.summon_full_params():
            self.module.reset_parameters()

    def assert_state(self, state) -> None:
        """FairScale's check between steps: state (or a list of them) names IDLE, as FairScale's
        TrainingState.IDLE does, when no backward and no summon_full_params() is under way."""
        names = {getattr(s, "name", s) for s in (state if isinstance(state, list) else [state])}
        engine = self._engine_of()
        now = ("SUMMON_FULL_PARAMS" if self._summoned else
               "BACKWARD_PRE" if engine._in_backward else "IDLE")
        assert now in names, f"FullyShardedDataParallel is {now}, not {sorted(names)}"

    def extra_repr(self) -> str:
        return self.settings.describe() if self.settings.verbose else ""

    def __repr__(self) -> str:
        """print(model) shows the wrapped model (FairScale's way to see the wrapping): the root's
        is not a registered child, so nn.Module's repr would leave it out."""
        if self.engine is None:
            return super().__repr__()
        lines = [self.extra_repr()] if self.extra_repr() else []
        lines.append("(module): " + repr(self.module).replace("\n", "\n  "))
        return f"{type(self).__name__}(\n  " + "\n  ".join(lines) + "\n)"


def _take_over(module: nn.Module, settings) -> list[FullyShardedDataParallel]:
    """FairScale's wrapping again (a model wrapped, trained, then wrapped anew for inference): the
    FSDP that had the module (or one inside it) hands it over, as an inner one does
    (_become_unit); that wrapper then runs through this one's engine."""
    # in the parameters' order, the same on every rank (their collectives must line up)
    owners = dict.fromkeys(p._fsdp_owner() for p in module.parameters()
                           if hasattr(p, "_fsdp_owner"))
    handed_over = []
    for owner in owners:
        if owner is None or owner.retired or not any(m is owner.module for m in module.modules()):
            continue
        wrapper = owner.wrapper()
        if wrapper is None:                   # nobody holds the old wrapper: only its engine goes
            _hand_back(owner)
        else:
            wrapper._become_unit(settings)
            handed_over.append(wrapper)
    return handed_over


def _hand_back(engine: FSDPEngine) -> nn.Module:
    """Retire an engine: its module's parameters and buffers take their full values back (fp32,
    from the masters) and its hooks go; the module. Collective."""
    module, state = engine.module, engine.retire()
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            t.data = state[name].to(t.device)
    return module


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
