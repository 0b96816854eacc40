"""What `fully_shard` makes of a module: the class FSDP<Class> (FSDPModule's methods before the
module's own), its forward hook, and its ownership of the shards.

    model.blocks[0].unshard(async_op=True).wait()        # the unit's parameters whole, now
    model.set_requires_gradient_sync(False)              # gradient accumulation without sync
    isinstance(model, minizero.pytorch.FSDPModule)       # True

Run its tests:  python -m pytest tests/test_fully_shard.py tests/test_fully_shard_scenarios.py \
                    tests/test_fully_shard_state.py

The methods are FSDP2's, with its names and arguments; each asks the unit (fsdp_unit.py) or the
units below (recurse=True) to do something, or sets one of their switches.
"""

from __future__ import annotations

import functools
import warnings

from torch import nn

from minizero import owners
from minizero.pytorch.fsdp_unit import Unit

OWNER = owners.Owner("minizero.fully_shard")      # its claim on the shards (owners.py)


def pre_forward_hook(unit: Unit, module, args, kwargs):
    """Before each of a unit's modules runs forward (fully_shard registers it)."""
    if not unit.root.started:                     # the first forward through this unit: if no
        unit.root.start()                         # root adopted it, it is the root
    return unit.pre_forward(module, args, kwargs)


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

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of set_gradient_divide_factor."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use "
                      "set_gradient_divide_factor", FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward does not gather this unit (an embedding's backward needs only the
        indices, not the weight): one all-gather less a step."""
        self._fsdp_unit.unshard_in_backward = bool(unshard_in_backward)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """True: a trainable parameter that got no gradient on this rank is reduced as zeros, so
        ranks whose forwards use different parameters still issue the same reduce-scatter."""
        for unit in self._fsdp_units(recurse):
            unit.reduce_unused = bool(reduce_scatter_unused_params)

    def set_post_optim_event(self, event) -> None:
        """FSDP2's stream synchronisation after the optimizer step: minizero runs its collectives
        on the current stream, so there is nothing to wait for (said once)."""
        warnings.warn("set_post_optim_event has no effect: minizero's fully_shard runs its "
                      "collectives on the current stream", stacklevel=2)

    def reset_iter_state(self) -> None:
        """After a forward or backward raised: wait for the collectives in flight, drop this
        iteration's gradients not reduced yet, leave every unit resharded and idle. On the root."""
        root = self._fsdp_unit.root
        if root.started and self._fsdp_unit is not root.units[0]:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        root.reset()

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


def fsdp_class(cls: type) -> type:
    """FSDP<Class>: the module's class with FSDPModule's methods first."""
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
        args, kwargs = pre_forward_hook(unit, module, args, kwargs)
        return unit.post_forward(module, args, method(*args, **kwargs))
    setattr(module, method_name, hooked)
