"""Stage 3's units as wrap's engines use them: which modules, and what a real model needs of them.

    engine = minizero.wrap(model, 3, optimizer)                    # default_units(model)
    engine = minizero.wrap(model, 3, optimizer, units=list(model.blocks))
    minizero.set_z3_leaf_modules(model, [MoEBlock])     # DeepSpeed's: each one gathered whole

Run its tests:  python -m pytest tests/test_zero3_units.py

A unit is the granularity of stage 3 (zero3.py): the largest unit, not the model, bounds the
parameter memory in flight. FSDP users choose units with a wrap policy (a transformer's blocks, or
by size); DeepSpeed fetches module by module. zero3.py holds the paper's unit; ModelUnits and
ModelUnit below are it with the pieces wrap's engines plug in (assembled.py):
  * default units (default_units) and leaf modules ([Note: leaf modules]);
  * a free unit's parameters refuse writes (absent.py), engine.gathered() holds units gathered
    (absent.HeldForUser), a returned parameter keeps its unit ([Note: returned parameters]);
  * [Note: recompute] activation checkpointing reruns a unit's forward in backward, which must
    neither free it nor prefetch: engine.backward() puts every unit in PRE_BACKWARD first;
  * FairScale's reshard_after_forward=False (the engine's keeps_gathered);
  * sharded_init's models (construct.take_value), ZeRO++'s routes (beyond/quantize.py, hpz.py).

[Note: leaf modules] Every rank must gather the same units in the same order: a unit's all-gather
is a collective. A module whose forward takes a path that depends on the rank or the data (an MoE
layer routing to some experts, `self.experts[rank]`) would have each rank gather other units, and
the ranks would exchange the wrong partitions. DeepSpeed's answer, kept here with its names and its
flag (the `_z3_leaf` attribute, so a model flagged by deepspeed.utils works as it is): a *leaf
module* is one unit, gathered whole before its forward whatever path runs inside it; no module
inside it is a unit. More memory in flight (the whole leaf), the same collectives on every rank.
minizero.initialize flags DeepSpeed's defaults (Mixtral's and Qwen's sparse MoE blocks) and the
config's zero_optimization.leaf_module, as deepspeed.initialize does.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from minizero import comm, construct
from minizero.absent import HeldForUser, refuse_writes
from minizero.beyond.hpz import HpzUnit, secondaries
from minizero.zero3 import ShardedUnits, TrainingState, Unit

UNIT_SHARE = 1 / 8  # default units without transformer blocks hold at most Ψ/8 each (default_units)
LEAF = "_z3_leaf"   # DeepSpeed's flag on a leaf module ([Note: leaf modules])
# What deepspeed.initialize flags when the config says nothing (zero/leaf_module_config.py, 0.19.8)
DEFAULT_LEAF_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


def default_units(model: nn.Module) -> list[nn.Module]:
    """The units when none are given, so that no unit holds much of Ψ (the trainable parameters).

    1. A transformer: the blocks of the first nn.ModuleList holding most of Ψ, if none holds
       more than half: one unit per block, as FSDP users wrap; the model keeps the rest
       (embeddings, head), < Ψ/2.
    2. Any other model, by size (FSDP's size-based auto-wrap, turned to bound the largest unit):
       walking down from the model, a submodule holding at most UNIT_SHARE·Ψ is a unit; a bigger one
       is a unit of the parameters it holds directly, and its children are visited in turn. No unit
       exceeds Ψ/8 but the parameters one module holds directly (a single big weight, say) and a
       weight tied across units.
    Why Ψ/8: with prefetch two units are gathered at once, so parameters peak near Ψ/N + Ψ/4;
    smaller units save little more and each costs one more all-gather (and its latency) per use.
    """
    # frozen count: memory
    size = {id(m): sum(p.numel() for p in m.parameters()) for m in model.modules()}
    total = size[id(model)]
    for m in model.modules():
        if (
            isinstance(m, nn.ModuleList)
            and size[id(m)] > total / 2
            and all(size[id(b)] <= total / 2 for b in m)
        ):
            return list(m)
    units = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            units.append(child)
            if size[id(child)] > UNIT_SHARE * total:
                visit(child)
    visit(model)
    return units


def resolve(model: nn.Module, units: list[nn.Module] | None) -> list[tuple]:
    """The units stage 3 cuts the model into, as (module, the parameters it owns) in forward order:
    `units` (wrap's units=) or default_units(model), with every outermost leaf module one unit
    ([Note: leaf modules]); warns when a chosen unit holds most of Ψ (little saved)."""
    chosen = units is not None
    modules, owned = assign_units(
        model, with_leaves(model, default_units(model) if units is None else units, chosen))
    sizes = [sum(p.numel() for p in params) for params in owned]
    largest = max(range(len(modules)), key=sizes.__getitem__)
    share = sizes[largest] / sum(sizes)
    if chosen and share > 0.5 and not z3_leaf_module(modules[largest]):
        name = next(n for n, m in model.named_modules() if m is modules[largest]) or "<root>"
        warnings.warn(f"stage 3: unit {name!r} holds {share:.0%} of the parameters; pass "
                      "units= with smaller submodules (e.g. each block)", stacklevel=5)
    return list(zip(modules, owned))


def assign_units(model: nn.Module, units: list[nn.Module]):
    """(unit modules, the parameters each owns), in forward order, the model first. A parameter is
    the innermost unit's holding every module that uses it: a weight tied across units (a GPT's
    embedding and head) is gathered whenever either needs it. Units owning nothing are dropped."""
    order = {id(m): i for i, m in enumerate(model.modules())}
    units = sorted({id(u): u for u in [model, *units]}.values(), key=lambda u: order[id(u)])
    members = {id(u): {id(m) for m in u.modules()} for u in units}
    holders: dict[int, set[int]] = {}                   # parameter -> modules that hold it directly
    for m in model.modules():
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(id(m))
    owned: dict[int, list[nn.Parameter]] = {id(u): [] for u in units}
    for p in model.parameters():
        innermost = min((u for u in units if holders[id(p)] <= members[id(u)]),
                        key=lambda u: len(members[id(u)]))
        owned[id(innermost)].append(p)
    kept = [u for u in units if owned[id(u)]]
    return kept, [owned[id(u)] for u in kept]



# --------------------------------------------------------------------------------------------------
# Leaf modules: DeepSpeed's API (deepspeed.utils.set_z3_leaf_modules and friends, 0.19.8)
# --------------------------------------------------------------------------------------------------

def with_leaves(model: nn.Module, units: list[nn.Module], chosen: bool = False) -> list[nn.Module]:
    """The units with every outermost leaf module made one unit and the units inside it dropped
    (a leaf inside a leaf is part of the outer one), in the model's module order."""
    leaves, inside = [], set()
    for m in model.modules():
        if id(m) not in inside and z3_leaf_module(m):
            leaves.append(m)
            inside.update(id(d) for d in m.modules() if d is not m)
    if not leaves:
        return list(units)
    dropped = [u for u in units if id(u) in inside]
    if chosen and dropped:
        warnings.warn(f"stage 3: {len(dropped)} of the units given lie inside a leaf module and "
                      "are gathered with it (a leaf module is one unit)", stacklevel=5)
    order = {id(m): i for i, m in enumerate(model.modules())}
    kept = {id(u): u for u in [*units, *leaves] if id(u) not in inside}
    return sorted(kept.values(), key=lambda u: order[id(u)])


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether `module` is flagged as a leaf module."""
    return bool(getattr(module, LEAF, False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` flagged as leaf modules."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: list,
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Flag every module of these classes (classes, or names: the class's own or
    module.qualname) as a leaf module; returns them. ValueError if none matches (unless
    raise_if_not_found=False)."""
    return _flag_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: list,
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Clear the flag of every module of these classes; returns them."""
    return _flag_classes(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True
                                ) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules named (as in model.named_modules()); returns (matched, missing names)."""
    by_name = dict(model.named_modules())
    matched = [by_name[n] for n in module_names if n in by_name]
    missing = [n for n in module_names if n not in by_name]
    return _flag(model, matched, missing, flag, raise_if_not_found, "named")


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: list[str],
                                  flag: bool = True, raise_if_not_found: bool = True
                                  ) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules whose name ends with one of the suffixes; returns (matched, unmatched
    suffixes)."""
    named = list(model.named_modules())
    matched = list({id(m): m for s in module_name_suffixes for n, m in named
                    if n.endswith(s)}.values())
    missing = [s for s in module_name_suffixes if not any(n.endswith(s) for n, _ in named)]
    return _flag(model, matched, missing, flag, raise_if_not_found, "matching the suffixes")


def apply_leaf_module_config(model: nn.Module, classes=DEFAULT_LEAF_CLASSES, names=(),
                             name_suffixes=()) -> list[nn.Module]:
    """zero_optimization.leaf_module ({"classes", "names", "name_suffixes"}, DeepSpeed's defaults
    for those left out), as deepspeed.initialize applies it: flags what matches; a name or suffix
    that matches nothing is one warning line. Returns the modules flagged."""
    found = set_z3_leaf_modules(model, list(classes), raise_if_not_found=False)
    for how, values in (("names", names), ("name suffixes", name_suffixes)):
        setter = set_z3_leaf_modules_by_name if how == "names" else set_z3_leaf_modules_by_suffix
        matched, missing = setter(model, list(values), raise_if_not_found=False)
        found += matched
        if missing:
            warnings.warn(f"zero_optimization.leaf_module: no module matches the {how} {missing}",
                          stacklevel=3)
    return list({id(m): m for m in found}.values())


def _flag_classes(model: nn.Module, classes: list, flag: bool, raise_if_not_found: bool
                  ) -> list[nn.Module]:
    if not all(isinstance(c, (type, str)) for c in classes):
        raise TypeError(f"leaf_module_classes must be classes or class names, got {classes!r}")

    def matches(m: nn.Module, c) -> bool:
        if isinstance(c, type):
            return isinstance(m, c)
        cls = type(m)
        return c in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")
    matched = [m for m in model.modules() if any(matches(m, c) for c in classes)]
    return _flag(model, matched, [] if matched else list(classes), flag, raise_if_not_found,
                 "of the classes")[0]


def _flag(model: nn.Module, matched: list[nn.Module], missing: list, flag: bool,
          raise_if_not_found: bool, how: str) -> tuple[list[nn.Module], list]:
    if missing and raise_if_not_found:
        raise ValueError(f"no module {how} {missing} in {type(model).__name__}")
    for m in matched:
        setattr(m, LEAF, flag)
    return matched, missing


class ModelUnit(HpzUnit, Unit):
    """zero3.Unit with the pieces wrap's engines plug in (the module's docstring)."""

    def __init__(self, *args):
        self.held_for_user = False         # engine.gathered() holds it: forward does not free it
        super().__init__(*args)

    def point_params(self, gathered: bool) -> None:
        super().point_params(gathered)
        for p in self.params:
            refuse_writes(p, not gathered)            # absent.py

    def route_for(self, forward: bool):
        """Forward's all-gather by the family's forward route (qwZ: int8), the others as zero3.Unit
        (hpZ's: from the secondary in backward)."""
        return self.family.forward_route if forward else super().route_for(False)

    def pre_forward(self) -> None:
        if self.training_state == TrainingState.PRE_BACKWARD:   # a recompute [Note: recompute]
            self.gather()                              # reentrant: its first use in this backward
            return
        super().pre_forward()

    def post_forward(self) -> None:
        if self.training_state != TrainingState.PRE_BACKWARD:  # a recompute: its backward needs
            super().post_forward()                             # the parameters

    def stays_gathered(self) -> bool:
        return (self.held_for_user or self in self.family.returned.just_kept
                or (torch.is_grad_enabled() and self.owner.keeps_gathered(self)))

    def enter_backward(self) -> None:
        """engine.backward() starts (FSDP: the first gradient): [Note: recompute]."""
        self.training_state = TrainingState.PRE_BACKWARD

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


class ModelUnits(ShardedUnits):
    """zero3.ShardedUnits with ModelUnits: wrap's units, gathered() and returned parameters."""
    unit_class = ModelUnit
    value_of = staticmethod(construct.take_value)      # a model built by sharded_init: gathered

    def __init__(self, engine, buckets: None, options):
        super().__init__(engine, buckets,
                         dataclasses.replace(options, units=resolve(engine.module, options.units)))
        self.forward_route = engine.int8_codec(options.quantization_block) \
            if options.quantized_weights else comm              # qwZ (beyond/quantize.py)
        self.returned = ReturnedParameters(engine.module,
                                           {id(p): u for u in self.units for p in u.params})
        self.for_user = HeldForUser(self.units, self.layout)       # engine.gathered() (absent.py)
        self.hooks.append(engine.module.register_forward_hook(self._model_forward_ends))

    def _pre_forward(self, unit: ModelUnit, module, args) -> None:
        self.returned.enter(unit)
        super()._pre_forward(unit, module, args)

    def _post_forward(self, unit: ModelUnit, module, args, output) -> None:
        kept = self.returned.keep(unit, tree_flatten(output)[0])   # [Note: returned parameters]
        super()._post_forward(unit, module, args, output)
        self.returned.release(unit, kept)              # what units inside it returned: used now

    def _model_forward_ends(self, module, args, output) -> None:
        self.returned.release(self.engine.module, [])

    def before_backward(self) -> None:
        for unit in self.units:                        # a forward from here on is a recompute
            unit.enter_backward()                      # [Note: recompute]

    def tensors(self, category: str) -> list[torch.Tensor]:
        """The shards, and hpZ's secondaries (parameters, on the device)."""
        return super().tensors(category) + (secondaries(self.units) if category == "params"
                                            else [])


class ReturnedParameters:
    """[Note: returned parameters] A module may return a parameter itself (a bias the caller adds,
    DeepSpeed's test_zero_context_return). Its unit stays gathered until the unit around the caller
    finishes its forward, since the caller reads the parameter after the module's post-forward
    (freed, it would read NaN: [Note: absent parameters] in absent.py). ModelUnits tells this class
    each forward's start and end; it answers which units to keep and which to free."""

    def __init__(self, model: nn.Module, unit_of_param: dict):
        self.model, self.unit_of_param = model, unit_of_param
        self._in_forward: list = []      # units whose forward runs, innermost last
        self._waiting: dict = {}         # id(the unit around a caller, or the model) -> units kept
        self.just_kept: list = []        # the units keep() kept last: their post-forward keeps them

    def enter(self, unit) -> None:
        self._in_forward.append(unit)

    def keep(self, unit, outputs: list) -> list:
        """unit's forward returned `outputs`: the units of the parameters among them, kept now."""
        if self._in_forward and self._in_forward[-1] is unit:
            self._in_forward.pop()
        owners = {id(self.unit_of_param[id(t)]): self.unit_of_param[id(t)] for t in outputs
                  if isinstance(t, nn.Parameter) and id(t) in self.unit_of_param}
        self.just_kept = list(owners.values())
        if not owners:
            return []
        for waiting in self._waiting.values():        # handed on outwards, not freed twice
            waiting[:] = [u for u in waiting if id(u) not in owners]
        # no unit around the caller: the model's forward is, and its end frees them
        around = self._in_forward[-1] if self._in_forward else self.model
        self._waiting.setdefault(id(around), []).extend(owners.values())
        return list(owners.values())

    def release(self, around, kept: list) -> None:
        """`around` (a unit, or the model) finished its forward: free the units kept for it."""
        self.just_kept = []
        if around is self.model:
            self._in_forward.clear()
        for unit in self._waiting.pop(id(around), []):
            if unit not in kept:
                unit.release_returned()
