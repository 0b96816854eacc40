"""Sharded construction: build a model that never exists in full on any rank (stage 3).

    with minizero.sharded_init() as init:      # inside a process group: minizero.launch or torchrun
        model = MyModel(cfg)                     # every rank runs the same constructor
    # units are built from the partitions, one at a time
    engine = minizero.wrap(model, 3, optimizer)
    init.peak_bytes, init.shard_bytes            # what construction held at most, and what it keeps

Run its tests:  python -m pytest tests/test_construct.py

Why: stage 3 holds (2 + 2 + K)Ψ/N bytes per rank, but a model built the usual way holds all Ψ
parameters on every rank first, so a model that only fits sharded could never be built. DeepSpeed
solves this with `zero.Init`, FSDP2 with meta-device construction plus a re-initialisation; this is
the first kind.

How, for the parameters of each module (buffers are small and stay as they are):
  1. A module's __init__ creates its parameters in full, exactly as without this context, so the
     random stream is consumed in the same order and the values are those of a normal build.
  2. When the module is attached to its parent (its __init__ has returned), each of its parameters
     is *partitioned*: broadcast from rank 0 (all ranks start from rank 0's values, as Engine does),
     flattened, padded to a multiple of N, and rank r keeps chunk r [⌈numel/N⌉]; the parameter's
     storage is released (0 bytes, shape kept), as stage 3 releases a unit. What is never attached
     (the root) is partitioned when the context closes; then every partitioned parameter becomes
     absent, as a free unit's are (absent.py's [Note: absent parameters]: read between here and
     wrap, it shows NaN rather than freed memory).
  3. Constructors often write their children's parameters after building them (a GPT's
     `self.apply(_init_weights)`, Hugging Face's `post_init`). While the context is open a torch
     function mode watches every torch call: one that touches a partitioned parameter (or a view of
     it) first all-gathers it, runs, and partitions it again, keeping whatever the call wrote. Every
     rank runs the same constructor, so these collectives line up.
So at any moment a rank holds its chunks plus the parameters of the modules under construction (or
of the one call being made): peak ≈ Ψ/N + the largest module, not Ψ.

Limits: the constructor must be deterministic across ranks (the same code; values may differ, rank
0's win); parameters that are views into a larger tensor are left whole.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from minizero import comm
from minizero.flat import padded_size
from minizero.absent import absent_like

# Calls that only read a tensor's metadata (never its values): no gather needed. Attribute reads
# (`p.shape`, `p.data`: a `__get__`) are metadata too; `p.data` is a view and stays partitioned.
_METADATA = {
    "numel", "nelement", "size", "dim", "ndimension", "element_size", "stride", "storage_offset",
    "is_contiguous", "is_floating_point", "is_complex", "requires_grad_", "untyped_storage",
    "__get__", "__set__", "_set_grad_enabled",
}


class Partition:
    """What a rank keeps of one partitioned parameter: chunk r of its flattened, padded values."""

    def __init__(self, param: torch.Tensor, chunk: torch.Tensor):
        self.shape, self.numel = param.shape, param.numel()
        self.chunk = chunk                       # [⌈numel/N⌉], this rank's part

    def gather(self, param: torch.Tensor) -> None:
        """Give `param` (or any tensor on its storage) its storage back, filled from every
        rank's chunk."""
        storage = param.untyped_storage()
        storage.resize_(self.numel * param.element_size())
        flat = torch.empty(
            self.chunk.numel() * comm.world_size(), dtype=param.dtype, device=param.device
        )
        comm.all_gather(
            flat, self.chunk, tag="sharded_init: a call touching a partitioned parameter"
        )
        _whole(param).copy_(flat[: self.numel])

    def release(self, param: torch.Tensor) -> None:
        """Keep this rank's chunk of the current values (a call may have written them), free
        the rest."""
        self.chunk.copy_(_chunk_of(_whole(param)))
        param.untyped_storage().resize_(0)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A flat view of all of t's storage (t may be a view of the parameter, e.g. p.data or p[0])."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage()).view(-1)


def _chunk_of(flat: torch.Tensor) -> torch.Tensor:
    n, r = comm.world_size(), comm.rank()
    size = padded_size(flat.numel(), n) // n
    chunk = torch.zeros(size, dtype=flat.dtype, device=flat.device)
    mine = flat[r * size: (r + 1) * size]        # the last ranks' slices run short: padding
    chunk[: mine.numel()].copy_(mine)
    return chunk


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata          # the storage object itself: views and .data share it


# Partitions by storage, so a view of a partitioned parameter is recognised too. Weak: a parameter
# that is replaced (a tied weight overwriting another) takes its partition with it.
_partitions: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def partition_of(t: torch.Tensor) -> Partition | None:
    """The partition of a parameter built under sharded_init (or, while building, of a view
    of one)."""
    if not torch.is_tensor(t):
        return None
    return getattr(t, "_minizero_partition", None) or _partitions.get(_key(t))


# --- what the engines do with a model built this way ----------------------------------------------

def cast_partitions(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Engine's model.to(device, dtype) for partitioned parameters: cast the chunk, and make the
    parameter absent in the new dtype (model.to would read its values otherwise: there are none)."""
    for p in model.parameters():
        part = partition_of(p)
        if part is not None and p.is_floating_point() and (p.dtype, p.device) != (dtype, device):
            part.chunk = part.chunk.to(device=device, dtype=dtype)
            p.data = absent_like(p, dtype, device)             # no values to cast, none read


def full_value(param: torch.Tensor) -> torch.Tensor:
    """Collective: a new full copy of a partitioned parameter (stage 3 builds each unit
    from these)."""
    part = partition_of(param)
    chunk = part.chunk
    flat = torch.empty(chunk.numel() * comm.world_size(), dtype=chunk.dtype, device=chunk.device)
    comm.all_gather(flat, chunk, tag="stage 3: a unit built from sharded_init's partitions")
    return flat[: part.numel].view(part.shape)


def take_value(param: torch.Tensor) -> torch.Tensor:
    """Stage 3 building a unit: the parameter's full value (gathered if built partitioned), after
    which its partition is forgotten (its chunk freed)."""
    value = full_value(param) if partition_of(param) is not None else param.detach()
    forget(param)
    return value


def forget(param: torch.Tensor) -> None:
    """Drop a parameter's partition once stage 3 has its values in a unit (its chunk is freed)."""
    if hasattr(param, "_minizero_partition"):
        del param._minizero_partition


class sharded_init(TorchFunctionMode):
    """Context manager: parameters of modules built inside it are partitioned over the ranks
    (see top)."""

    def __init__(self):
        super().__init__()
        self._full: dict[int, weakref.ref] = {}   # parameters created but not partitioned yet
        self._partitioned: list[weakref.ref] = []  # and those partitioned
        self._held = 0                            # bytes of parameters held in full right now
        self.shard_bytes = 0                      # bytes of the chunks this rank keeps
        self.peak_bytes = 0                       # the most parameter bytes held at any moment
        self._hooks: list = []

    # --- entering and leaving ---------------------------------------------------------------------
    def __enter__(self):
        self._hooks = [nn_module.register_module_parameter_registration_hook(self._on_parameter),
                       nn_module.register_module_module_registration_hook(self._on_submodule)]
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        if exc[0] is None:
            # the root's own parameters, and any never attached
            for ref in list(self._full.values()):
                if ref() is not None:
                    self._partition(ref())
            # no call gathers them any more: each is absent until stage 3 builds its unit
            for param in [p for p in (ref() for ref in self._partitioned) if p is not None]:
                _partitions.pop(_key(param), None)      # found by its attribute from now on
                param.data = absent_like(param)
        self._full.clear()
        self._partitioned.clear()
        return out

    # --- 1-2: parameters appear in full, and are partitioned once their module is built -----------
    def _on_parameter(self, module, name, param):
        if param is not None and partition_of(param) is None and _key(param) not in self._full:
            self._full[_key(param)] = weakref.ref(param)
            self._count(param.numel() * param.element_size())

    def _on_submodule(self, parent, name, child):
        if child is not None:
            for p in child.parameters():
                if partition_of(p) is None:
                    self._partition(p)

    def _partition(self, param: nn.Parameter) -> None:
        with torch.no_grad(), torch._C.DisableTorchFunction():   # our own calls: not watched
            nbytes = param.numel() * param.element_size()
            if param.untyped_storage().nbytes() != nbytes:
                return                           # a view into a larger tensor: left whole (see top)
            comm.broadcast(param.data, src=0, tag="sharded_init: rank 0's values")  # as Engine does
            part = Partition(param, _chunk_of(param.detach().reshape(-1)))
            param.untyped_storage().resize_(0)     # <- the essential line: the full values are gone
        _partitions[_key(param)] = part
        param._minizero_partition = part             # the parameter keeps its partition alive
        self._partitioned.append(weakref.ref(param))
        self._full.pop(_key(param), None)
        chunk_bytes = part.chunk.numel() * part.chunk.element_size()
        self.shard_bytes += chunk_bytes
        # a replaced parameter (a tie) frees its chunk
        weakref.finalize(param, self._forget, chunk_bytes)
        self._count(-nbytes)

    def _forget(self, chunk_bytes: int) -> None:
        self.shard_bytes -= chunk_bytes

    def _count(self, delta: int) -> None:
        self._held += delta
        self.peak_bytes = max(self.peak_bytes, self._held + self.shard_bytes)

    # --- 3: a call that touches a partitioned parameter gathers it first --------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _METADATA:
            return func(*args, **kwargs)
        touched, seen = [], set()
        for t in tree_flatten((args, kwargs))[0]:
            part = partition_of(t)
            if part is not None and _key(t) not in seen:
                seen.add(_key(t))
                touched.append((t, part))
        for t, part in touched:
            part.gather(t)
            self._count(part.numel * t.element_size())
        try:
            return func(*args, **kwargs)
        finally:
            for t, part in touched:
                with torch.no_grad():
                    part.release(t)
                self._count(-part.numel * t.element_size())
