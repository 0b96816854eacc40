"""FairScale's wrap helpers (fairscale.nn.wrap) for minizero.FullyShardedDataParallel: choosing the
units by wrapping submodules in FSDP, which the outermost FSDP adopts (fairscale/fsdp.py).

    from minizero.fairscale.fsdp_wrap import enable_wrap, wrap, auto_wrap, default_auto_wrap_policy
    with enable_wrap(wrapper_cls=minizero.FullyShardedDataParallel, mixed_precision=False):
        block = wrap(Block())                                   # an FSDP: one unit
        body = auto_wrap(model.body, functools.partial(default_auto_wrap_policy,
                                                       min_num_params=10_000))
    model = minizero.FullyShardedDataParallel(model)            # the root adopts them

Run its tests:  python -m pytest tests/test_fairscale_scenarios.py

Outside enable_wrap(), wrap() and auto_wrap() return the module unchanged (a model builds the same
code with or without FSDP). auto_wrap walks down from a module: the policy says whether to look
into a module (recurse=True, given its parameters not wrapped yet) and whether to wrap it
(recurse=False, given the parameters its wrapped children left); a module's children are decided
before the module itself, so the largest modules get what their children did not take.
"""

from __future__ import annotations

import contextlib
from typing import Callable

from torch import nn


def default_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int,
                             module_is_root: bool, min_num_params: int = int(1e8),
                             force_leaf_modules: set[type] | None = None,
                             exclude_wrap_modules: set[type] | None = None,
                             skip_params_check_for_root: bool = False) -> bool:
    """FairScale's size policy: look into a module holding >= min_num_params not wrapped yet
    (unless it is a forced leaf), and wrap one whose remainder is that large (never a container
    such as nn.ModuleList, which has no forward)."""
    leaves = default_auto_wrap_policy.FORCE_LEAF_MODULES if force_leaf_modules is None \
        else force_leaf_modules
    excluded = default_auto_wrap_policy.EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None \
        else exclude_wrap_modules
    large = unwrapped_params >= min_num_params
    if recurse:
        return large and not isinstance(module, tuple(leaves))
    wanted = large or (module_is_root and skip_params_check_for_root)
    return wanted and not isinstance(module, tuple(excluded))


default_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}
default_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}


def config_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int,
                            module_is_root: bool) -> bool:
    """Wrap exactly the modules given a `wrapper_config` attribute; look everywhere."""
    return recurse or hasattr(module, "wrapper_config")


class _Context:
    """What enable_wrap() set: the wrapper class, its keywords, auto_wrap's default policy."""
    wrapper_cls: Callable | None = None
    kwargs: dict = {}
    policy: Callable | None = None


@contextlib.contextmanager
def enable_wrap(auto_wrap_policy: Callable | None = None, **wrapper_kwargs):
    """Inside, wrap() and auto_wrap() wrap with wrapper_kwargs["wrapper_cls"] (required) and the
    other keywords. Not nested (FairScale's rule)."""
    if _Context.wrapper_cls is not None:
        raise NotImplementedError("enable_wrap() is active already: it does not nest")
    if "wrapper_cls" not in wrapper_kwargs:
        raise TypeError("enable_wrap() needs wrapper_cls=, e.g. minizero.FullyShardedDataParallel")
    kwargs = dict(wrapper_kwargs)
    _Context.wrapper_cls = kwargs.pop("wrapper_cls")
    _Context.kwargs = kwargs
    _Context.policy = auto_wrap_policy or default_auto_wrap_policy
    try:
        yield
    finally:
        _Context.wrapper_cls, _Context.kwargs, _Context.policy = None, {}, None


def wrap(module: nn.Module, **wrap_overrides) -> nn.Module:
    """Inside enable_wrap(): the module wrapped, with the context's keywords, then the module's
    own `wrapper_config`, then these overrides. Outside: the module itself."""
    if _Context.wrapper_cls is None:
        return module
    kwargs = {**_Context.kwargs, **getattr(module, "wrapper_config", {}), **wrap_overrides}
    return _Context.wrapper_cls(module, **kwargs)


def auto_wrap(module: nn.Module, auto_wrap_policy: Callable | None = None, **kwargs) -> nn.Module:
    """Inside enable_wrap(): wrap the module's descendants (and the module) that the policy picks;
    outside: the module itself."""
    if _Context.wrapper_cls is None:
        return module
    return _wrap_down(module, auto_wrap_policy or _Context.policy, True, kwargs)[0]


def _wrap_down(module: nn.Module, policy: Callable, is_root: bool, kwargs: dict
               ) -> tuple[nn.Module, int]:
    """(the module, wrapped or with wrapped descendants; how many of its parameters are wrapped)."""
    if any(isinstance(m, _Context.wrapper_cls) for m in module.modules()):
        raise ValueError("auto_wrap: the module holds a wrapped module already (FairScale's rule: "
                         "auto_wrap once; or mark modules with wrapper_config)")
    total = sum(p.numel() for p in module.parameters())
    if not policy(module=module, recurse=True, unwrapped_params=total, module_is_root=is_root):
        return module, 0
    wrapped = 0
    for name, child in list(module.named_children()):
        new_child, count = _wrap_down(child, policy, False, kwargs)
        setattr(module, name, new_child)
        wrapped += count
    if policy(module=module, recurse=False, unwrapped_params=total - wrapped,
              module_is_root=is_root):
        return wrap(module, **kwargs), total
    return module, wrapped
