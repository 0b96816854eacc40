"""`minizero.fully_shard`: PyTorch's FSDP2 as its users write it, on minizero's comm layer.

    import minizero, torch
    for block in model.blocks:
        minizero.fully_shard(block)        # a unit per block: one all-gather, one reduce-scatter
    minizero.fully_shard(model)            # the root: what is left (embeddings, final norm, head)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # the shards: DTensors
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()                    # each shard's .grad: its rows of the averaged gradient
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

Run its tests:  python -m pytest tests/test_fully_shard.py tests/test_fully_shard_scenarios.py \
                    tests/test_fully_shard_state.py

FSDP2 (torch.distributed.fsdp.fully_shard) is ZeRO stage 3 with each parameter sharded on its own,
along dim 0 ([Note: dim-0 shards] in fsdp_param.py), where FairScale, DeepSpeed and FSDP1 (and
minizero.wrap) cut flat buffers. The module's own parameters become the shards: DTensors that the
user's optimizer, clip_grad_norm_, state_dict() and torch.distributed.checkpoint take as they are,
and .full_tensor() gives a parameter whole. Each call makes a unit (fsdp_unit.py: its lifecycle,
read beside zero3.py's), hooked on the module; the units under a root share a Root (fsdp_root.py:
its first forward finds them). The collectives are minizero.comm's, so they are tallied and on the
event stream with every other stage's; DTensor is only the container (its own collectives run where
the user asks for them: .full_tensor(), clip_grad_norm_'s norm, redistribute()).

Arguments, as torch 2.13's: mesh (a DeviceMesh, 1-D or 2-D for HSDP: fsdp_mesh.py; default every
rank), reshard_after_forward (None: True except for the root; True; False; or k ranks to keep 1/k
among), mp_policy and offload_policy (policies.py), ignored_params (left as they are: neither
sharded nor reduced). shard_placement_fn and dp_mesh_dims are refused in one line. The module's
class becomes FSDP<Class>, with FSDPModule's methods.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from minizero import comm, owners
from minizero.pytorch.fsdp_mesh import MeshGroups
from minizero.pytorch.fsdp_param import ShardedParam
from minizero.pytorch.fsdp_root import Root
from minizero.pytorch.fsdp_unit import Unit
from minizero.pytorch.policies import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                       resolve)

OWNER = owners.Owner("minizero.fully_shard")


def fully_shard(module: nn.Module | list[nn.Module], *, mesh=None,
                reshard_after_forward: bool | int | None = None, shard_placement_fn=None,
                mp_policy=MixedPrecisionPolicy(), offload_policy=None, ignored_params=None,
                dp_mesh_dims=None):
    """Shard `module`'s parameters (those no earlier call on a submodule took) on dim 0 across the
    mesh's ranks, in place; the module, now an FSDPModule. A list of modules is one unit (gathered
    and reduced together: a tied embedding and head, a final norm and head), each module an
    FSDPModule; the list is returned. Collective: every rank calls it, in the same order (blocks
    first, the root last)."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard: module must be a torch.nn.Module or a list of them, "
                            f"got {type(m).__name__}")
        if isinstance(m, FSDPModule):
            raise ValueError(f"fully_shard: this {type(m).__name__} is sharded already")
    if not modules:
        raise ValueError("fully_shard: an empty list of modules")
    for name, value in (("shard_placement_fn", shard_placement_fn),
                        ("dp_mesh_dims", dp_mesh_dims)):
        if value is not None:
            raise ValueError(f"fully_shard: {name} is not supported: minizero shards every "
                             "parameter on dim 0 of a 1-D or 2-D data-parallel mesh")
    mp = resolve(mp_policy, MixedPrecisionPolicy, "mp_policy")
    offload = resolve(OffloadPolicy() if offload_policy is None else offload_policy,
                      OffloadPolicy, "offload_policy")
    groups = MeshGroups(mesh, reshard_after_forward)
    found = _parameters(modules, _ignored(ignored_params))
    host = isinstance(offload, CPUOffloadPolicy)
    home = torch.device("cpu") if host else comm.device()      # where the shards live
    pin = host and offload.pinned()
    names = {id(p): name for p, _, name in found}
    owners.claim([p for p, _, _ in found], OWNER, names)
    params = [ShardedParam(p, places, groups.mesh, groups.placements, groups.shard_rank,
                           groups.shard_size, home, pin) for p, places, _ in found]
    unit = Unit(modules, params, groups, mp, home)
    for (original, _, _), sp in zip(found, params):
        original._minizero_sharded_in = unit.name          # a tied copy elsewhere is refused
        sp.register(gathered=False)
    owners.claim([sp.sharded for sp in params], OWNER, {id(sp.sharded): names[id(p)]
                                                         for (p, _, _), sp in zip(found, params)})
    unit.root = Root(modules[0], [unit])
    for m in modules:
        m._fsdp_unit = unit
        m.register_forward_pre_hook(functools.partial(_pre_forward, unit), prepend=True,
                                    with_kwargs=True)
        m.register_forward_hook(unit.post_forward)
        m.register_state_dict_pre_hook(lambda *args: unit.free())       # the shards, as DTensors
        m.register_load_state_dict_pre_hook(lambda *args: unit.free())  # loaded into them
        m.__class__ = _fsdp_class(type(m))
    return module


def _pre_forward(unit: Unit, module, args, kwargs):
    if not unit.root.started:                     # the first forward through this unit: if no
        unit.root.start()                         # root adopted it, it is the root
    return unit.pre_forward(module, args, kwargs)


def _parameters(modules: list[nn.Module], ignored: set[int]) -> list[tuple]:
    """(parameter, its places [(module, name)], its name) for each parameter this call shards:
    in parameters() order, without those a unit below holds and the ignored ones."""
    found: dict[int, tuple] = {}
    named = [(f"[{i}]" + (prefix and f".{prefix}") if len(modules) > 1 else prefix, sub)
             for i, module in enumerate(modules)
             for prefix, sub in module.named_modules(remove_duplicate=False)]
    for prefix, sub in named:
        for name, p in sub._parameters.items():
            if p is None or id(p) in ignored or hasattr(p, "_minizero_shard"):
                continue
            qualified = f"{prefix}.{name}" if prefix else name
            if hasattr(p, "_minizero_sharded_in"):
                raise ValueError(
                    f"fully_shard: {qualified} is tied to a parameter that fully_shard("
                    f"{p._minizero_sharded_in}) already shards: modules that share a parameter "
                    "must be in one unit (fully_shard([a, b]), or their common parent)")
            if isinstance(p, DTensor):
                raise ValueError(f"fully_shard: {qualified} is a DTensor already (tensor "
                                 "parallelism): minizero's fully_shard shards plain parameters")
            if p.dim() == 0 or p.shape[0] == 0:
                raise ValueError(f"fully_shard: {qualified} (of shape {tuple(p.shape)}) cannot be "
                                 "sharded on dim 0: pass it in ignored_params")
            entry = found.setdefault(id(p), (p, [], qualified))
            if not any(m is sub and n == name for m, n in entry[1]):
                entry[1].append((sub, name))
    params = list(found.values())
    dtypes = {p.dtype for p, _, _ in params}
    if len(dtypes) > 1:
        raise ValueError(f"fully_shard: the parameters of one unit must share a dtype, found "
                         f"{sorted(map(str, dtypes))}: shard the modules apart")
    return params


def _ignored(ignored_params) -> set[int]:
    if ignored_params is None:
        return set()
    try:
        ignored = list(ignored_params)
    except TypeError:
        raise TypeError("fully_shard: ignored_params must be a set of parameters") from None
    if not all(isinstance(p, torch.Tensor) for p in ignored):
        raise TypeError("fully_shard: ignored_params must be a set of parameters")
    return {id(p) for p in ignored}


class UnshardHandle:
    """FSDPModule.unshard(async_op=True)'s handle: wait() until the parameters are whole."""

    def __init__(self, unit: Unit | None):
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.gather()
            self._unit = None


class FSDPModule:
    """What fully_shard mixes into the module's class (FSDP<Class>): FSDP2's methods."""

    def __new__(cls, *args, **kwargs):
        """A new instance of an FSDP class (a sliced nn.Sequential, ...) is of the plain class."""
        plain = cls.__mro__[2]
        module = plain.__new__(plain, *args, **kwargs)
        module.__init__(*args, **kwargs)
        return module

    def _fsdp_units(self, recurse: bool) -> list[Unit]:
        modules = self.modules() if recurse else [self]
        return [m._fsdp_unit for m in modules if isinstance(m, FSDPModule)]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters (not recursive); the module then holds them whole
        until reshard() or its next post-forward / post-backward."""
        self._fsdp_unit.gather(prefetch=True)
        handle = UnshardHandle(self._fsdp_unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this unit's whole parameters; the module holds its shards again (not recursive)."""
        self._fsdp_unit.drop_secondary()
        self._fsdp_unit.free()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """False: backward keeps the whole gradients for the next one (no reduce-scatter, no
        HSDP all-reduce): gradient accumulation without communication, FSDP1's no_sync()."""
        for unit in self._fsdp_units(recurse):
            unit.reduce_grads = unit.all_reduce_grads = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters each backward but all-reduces across replicas only when
        it is True again (their sum)."""
        for unit in self._fsdp_units(recurse):
            unit.all_reduce_grads = bool(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool,
                                  recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got "
                             f"{type(reshard_after_forward).__name__}")
        for unit in self._fsdp_units(recurse):
            unit.after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """False: keep the parameters gathered after backward (the next forward needs no
        all-gather); meant for the micro-batches before the last, as FSDP2's."""
        for unit in self._fsdp_units(recurse):
            unit.reshard_after_backward = bool(reshard_after_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: keep this iteration's forward order for backward prefetching across several
        backwards (pipelining's micro-batches). Gradients are finished at every backward's end."""
        self._fsdp_unit.root.is_last_backward = bool(is_last_backward)

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        """Start these units' all-gathers when this one's forward starts (instead of the next)."""
        self._fsdp_unit.forward_prefetch = _units(modules)

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        """Start these units' all-gathers when this one's backward starts."""
        self._fsdp_unit.backward_prefetch = _units(modules)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by `factor` instead of averaging over the ranks."""
        self._fsdp_unit.divide_factor = float(factor)

    def _apply(self, *args, **kwargs):
        """model.to(dtype) / .double() / .to_empty(): on the shards (reshard first, as FSDP2).
        torch swaps a DTensor parameter's contents in place (torch.utils.swap_tensors), which
        refuses a tensor with a weak reference: owners.py's claim holds one, lifted meanwhile."""
        shards = [sp.sharded for sp in self._fsdp_unit.params]
        owners.release(shards, OWNER)
        self.reshard()
        try:
            return super()._apply(*args, **kwargs)
        finally:
            owners.claim(shards, OWNER)

    def __deepcopy__(self, memo):
        raise TypeError("fully_shard: a sharded module cannot be deep-copied: save its "
                        "state_dict() (or a torch.distributed.checkpoint) instead")


def _units(modules) -> list[Unit]:
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"expected FSDP modules (fully_shard's), got {type(m).__name__}")
    return [m._fsdp_unit for m in modules]


_classes: dict[type, type] = {}     # Class -> FSDP<Class>, made once


def _fsdp_class(cls: type) -> type:
    if cls not in _classes:
        _classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _classes[cls]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run `module.<method_name>` (generate, encode, ...) with the unit's forward hooks around it,
    as forward runs: its parameters gathered before, freed after. Not an FSDP module: nothing."""
    if not isinstance(module, FSDPModule):
        return
    method, unit = getattr(module, method_name), module._fsdp_unit

    @functools.wraps(method)
    def hooked(*args, **kwargs):
        args, kwargs = _pre_forward(unit, module, args, kwargs)
        return unit.post_forward(module, args, method(*args, **kwargs))
    setattr(module, method_name, hooked)
