"""Absent parameters: what a stage-3 parameter is while its values are partitioned over the ranks.

    python -m pytest tests/test_zero3.py -k absent

A free unit (zero3.py) and a model built by sharded_init (construct.py) point their parameters here:
shape, dtype and numel() stay true, every value reads NaN, and a write raises ParameterWriteError
with a line that says where to write instead. [Note: absent parameters] below says why.
"""

from __future__ import annotations

import functools
import math

import torch

from minizero import comm
from minizero.flat import partition


# [Note: absent parameters] Outside its unit's forward and backward, a stage-3 parameter's values
# are not on any one rank (each holds 1/N of them). Left a view of the freed `full`, it would point
# at 0 bytes, and reading it (print(model.lm_head.weight)) would read freed memory: a crash. So the
# unit points it at a NaN tensor of its shape instead (one element, expanded): shape, dtype, numel()
# stay true (a learner's count of parameters still works), what it reads is NaN (no value here), and
# a write to it raises ParameterWriteError (`refuse_writes`: torch alone would refuse some writes
# with a message about memory locations and let fill_ and zero_ through, into the one shared value).
# DeepSpeed makes it torch.empty(0) instead, FSDP2 a DTensor of the shard. To see the values: `with
# engine.gathered(params):`, or engine.full_state_dict().


def absent_like(p: torch.Tensor, dtype: torch.dtype | None = None,
                device: torch.device | None = None) -> torch.Tensor:
    """What a parameter built by sharded_init is until stage 3 gathers it (construct.py): its shape,
    NaN everywhere, 2-4 bytes shared by all of them (a free unit's own: zero3.Unit's `absent`)."""
    return _one_absent_value(dtype or p.dtype, device or p.device).expand(p.shape)


@functools.cache
def _one_absent_value(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full((1,), math.nan if dtype.is_floating_point else 0, dtype=dtype, device=device)


class ParameterWriteError(RuntimeError):
    """A write to a stage-3 parameter that could not take effect: one line saying where to write
    instead (engine.gathered(modifier_rank=...))."""


_IN_PLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                     "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__"}
_NOT_WRITES = {"requires_grad_", "share_memory_", "retain_grad"}     # in-place on flags, not values


def _refuse_if_written(func, args, kwargs) -> None:
    """Raise when `func` writes into an absent tensor: an in-place method or function (name ending
    in _: add_, fill_, nn.init.normal_) or operator on one, or one given as out=."""
    name = getattr(func, "__name__", "")
    in_place = name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("__")
                                             and name not in _NOT_WRITES)
    out = kwargs.get("out")
    targets = (out if isinstance(out, (tuple, list)) else (out,)) if out is not None else ()
    if in_place and args:
        targets += (args[0],)
    if any(isinstance(t, (_Absent, AbsentValues)) for t in targets):
        raise ParameterWriteError(
            f"{name}() writes to a stage-3 parameter outside engine.gathered(), "
            "whose values are partitioned over the ranks (its own reads NaN), so the write could "
            "not take effect: write inside `with engine.gathered(modifier_rank=r):` (rank r's "
            "values reach every rank)")


def _reads_only(func, args, kwargs):
    _refuse_if_written(func, args, kwargs)
    with torch._C.DisableTorchFunctionSubclass():                  # results are plain tensors
        return func(*args, **kwargs)


class AbsentValues(torch.Tensor):
    """What `p.data` of an absent parameter is: absent_like's values, refusing writes."""
    __torch_function__ = classmethod(lambda cls, func, types, args=(), kwargs=None:
                                     _reads_only(func, args, kwargs or {}))


_DATA = torch._C.TensorBase.data                                  # the descriptor behind p.data


class _Absent:
    """Mixed into an absent parameter's class while its unit is free (refuse_writes)."""
    __torch_function__ = AbsentValues.__torch_function__

    @property
    def data(self):
        return _DATA.__get__(self).as_subclass(AbsentValues)

    @data.setter
    def data(self, value):
        _DATA.__set__(self, value)


@functools.cache
def _absent_class(cls: type) -> type:
    return type(f"Absent{cls.__name__}", (_Absent, cls), {"own_class": cls})


def refuse_writes(p: torch.Tensor, refuse: bool) -> None:
    """Make p's class refuse writes (an absent parameter), or give it its own class back: the one
    way to catch a write through p or p.data with a minizero line. Costs nothing while gathered."""
    own = type(p).own_class if isinstance(p, _Absent) else type(p)
    p.__class__ = _absent_class(own) if refuse else own


# --- writes inside engine.gathered(modifier_rank=None), which could not take effect ---------------
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}   # by bytes


def write_marks(fulls: list[torch.Tensor], params) -> tuple[torch.Tensor, list[int]]:
    """What shows a write to gathered parameters: a checksum of each full buffer (its elements'
    bits, summed as integers: exact, and changed by any one element written) and where each
    parameter's values live (`p.data = ...` moves them)."""
    sums = [full.view(_SAME_SIZE_INT[full.element_size()]).sum(dtype=torch.int64)
            for full in fulls]
    return torch.stack(sums) if sums else torch.zeros(0), [p.data_ptr() for p in params]


def refuse_dropped_writes(now: tuple[torch.Tensor, list[int]],
                          before: tuple[torch.Tensor, list[int]]) -> None:
    """At the end of gathered(modifier_rank=None), given write_marks() now and before: if any rank
    wrote, every rank raises (one all-reduce of a flag per rank, so that no rank goes on alone and
    all name the writers)."""
    wrote = torch.zeros(comm.world_size(), device=comm.device())
    wrote[comm.rank()] = float(now[1] != before[1] or not torch.equal(now[0], before[0]))
    comm.all_reduce(wrote, op="sum", tag="gathered(modifier_rank=None): a write?")
    writers = [r for r, w in enumerate(wrote.tolist()) if w]
    if writers:
        raise ParameterWriteError(
            f"rank{'s' if len(writers) > 1 else ''} {', '.join(map(str, writers))} wrote to "
            "stage-3 parameters inside engine.gathered(modifier_rank=None), where a write "
            "cannot take effect (each rank keeps its partition from before the block): use "
            "engine.gathered(modifier_rank=r), and rank r's values reach every rank")


class HeldForUser:
    """engine.gathered() at stage 3: the units holding the parameters asked for are gathered until
    the block ends (a nested block keeps the outer's); what was written into them goes back into
    each rank's partition (after_write) or is refused (write_marks, refuse_dropped_writes)."""

    def __init__(self, units: list, layout):
        self.units, self.layout = units, layout
        self._held: list[list] = []         # the units each open block gathered, innermost last

    def units_of(self, params) -> list:
        wanted = {id(p) for p in params}
        return [u for u in self.units if any(id(p) in wanted for p in u.params)]

    def gather(self, params) -> None:
        newly = [unit for unit in self.units_of(params) if not unit.held_for_user]
        for unit in newly:
            unit.hold_for_user()
        self._held.append(newly)

    def release(self) -> None:
        for unit in self._held.pop():
            unit.release_for_user()

    def after_write(self, params) -> None:
        """The full parameters were written: each rank takes its partition of them."""
        for unit in self.units_of(params):
            for full, shard in unit.buffers():
                shard.copy_(partition(full, self.layout.rank, self.layout.world_size))

    def write_marks(self, params) -> tuple[torch.Tensor, list[int]]:
        return write_marks([full for u in self.units_of(params) for full, _ in u.buffers()],
                           params)
