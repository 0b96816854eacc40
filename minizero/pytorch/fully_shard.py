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
from minizero.pytorch.fsdp_module import OWNER, FSDPModule, fsdp_class, pre_forward_hook
from minizero.pytorch.fsdp_param import ShardedParam
from minizero.pytorch.fsdp_root import Root
from minizero.pytorch.fsdp_unit import Unit
from minizero.pytorch.policies import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                       resolve)

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
    found, tied = _parameters(modules, _ignored(ignored_params))
    host = isinstance(offload, CPUOffloadPolicy)
    home = torch.device("cpu") if host else comm.device()      # where the shards live
    pin = host and offload.pinned()
    names = {id(p): name for p, _, name in found}
    owners.claim([p for p, _, _ in found], OWNER, names)
    params = [ShardedParam(p, places, groups.mesh, groups.placements, groups.shard_rank,
                           groups.shard_size, home, pin) for p, places, _ in found]
    unit = Unit(modules, params, groups, mp, home)
    unit.tied_apart = tied              # refused at the first forward, as FSDP2's lazy init does
    for (original, _, _), sp in zip(found, params):
        original._minizero_sharded_in = unit.name          # a tied copy elsewhere is refused
        sp.register(gathered=False)
    owners.claim([sp.sharded for sp in params], OWNER, {id(sp.sharded): names[id(p)]
                                                         for (p, _, _), sp in zip(found, params)})
    unit.root = Root(modules[0], [unit])
    for m in modules:
        _move_buffers(m, comm.device())
        m._fsdp_unit = unit
        m.register_forward_pre_hook(functools.partial(pre_forward_hook, unit), prepend=True,
                                    with_kwargs=True)
        m.register_forward_hook(unit.post_forward)
        m.register_state_dict_pre_hook(lambda *args: unit.free())       # the shards, as DTensors
        m.register_load_state_dict_pre_hook(lambda *args: unit.free())  # loaded into them
        m.__class__ = fsdp_class(type(m))
    return module


def _parameters(modules: list[nn.Module], ignored: set[int]) -> tuple[list[tuple], list[str]]:
    """(parameter, its places [(module, name)], its name) for each parameter this call shards:
    in parameters() order, without those a unit below holds and the ignored ones; and a line for
    each parameter another unit shards already (tied to it: left as it is here, and refused at
    the first forward, where FSDP2 finds it too)."""
    found: dict[int, tuple] = {}
    tied: list[str] = []
    named = [(f"[{i}]" + (prefix and f".{prefix}") if len(modules) > 1 else prefix, sub)
             for i, module in enumerate(modules)
             for prefix, sub in module.named_modules(remove_duplicate=False)]
    for prefix, sub in named:
        for name, p in sub._parameters.items():
            if p is None or id(p) in ignored or hasattr(p, "_minizero_shard"):
                continue
            qualified = f"{prefix}.{name}" if prefix else name
            if hasattr(p, "_minizero_sharded_in"):
                tied.append(f"fully_shard: {qualified} is tied to a parameter already managed by "
                            f"another unit, fully_shard({p._minizero_sharded_in}): modules that "
                            "share a parameter must be in one unit (fully_shard([a, b]), or "
                            "their common parent)")
                continue
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
    return params, tied


def _move_buffers(module: nn.Module, device) -> None:
    """The module's buffers onto the device it computes on (its parameters' shards are there
    already), as torch's fully_shard moves them; on the CPU nothing moves."""
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and not buffer.is_meta and buffer.device != device:
                sub._buffers[name] = buffer.to(device)


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
