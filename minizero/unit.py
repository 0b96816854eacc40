"""What happens to one unit of stage 3: its buffers, states and four hooks (read zero3.py first).

    python -m pytest tests/test_zero3.py

FSDP2's FSDPParamGroup is the industrial version of `Unit`, with the same explicit states.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from minizero import comm, events
from minizero.flat import partition

FREE, IN_FLIGHT, GATHERED = "free", "in flight", "gathered"        # what unit.full holds
IDLE, FORWARD, PRE_BACKWARD = "idle", "forward", "pre-backward"    # where the step is, for the unit


def absent_like(p: torch.Tensor, dtype: torch.dtype | None = None,
                device: torch.device | None = None) -> torch.Tensor:
    """What a parameter of a free unit (or one built by sharded_init, construct.py) reads as: its
    shape, NaN everywhere, and 2-4 bytes shared by all of them (of p's dtype and device, or those
    given).

    [Note: absent parameters] Outside its unit's forward and backward, a stage-3 parameter's values
    are not on any one rank (each holds 1/N of them). Left a view of the freed `full`, it would
    point at 0 bytes, and reading it (print(model.lm_head.weight)) would read freed memory: a
    crash. So the unit points it at this instead: shape, dtype and numel() stay true (a learner's
    count of parameters still works), what it reads is NaN (no value here), and a write to it
    raises ParameterWriteError (`refuse_writes`: torch alone would refuse some writes with a
    message about memory locations and let fill_ and zero_ through, into the one shared value).
    DeepSpeed makes it torch.empty(0) instead, FSDP2 a DTensor of the shard. To see the values:
    `with engine.gathered(params):`, or engine.full_state_dict()."""
    return _one_absent_value(dtype or p.dtype, device or p.device).expand(p.shape)


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


@functools.cache
def _one_absent_value(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full((1,), math.nan if dtype.is_floating_point else 0, dtype=dtype, device=device)


@dataclass(frozen=True)
class UnitRoutes:
    """How a unit's partitions travel (comm.Route), chosen by zero3.py: `forward` before forward
    (qwZ: int8), `exact` every other, `node` hpZ's in backward. The paper's: Route(), Route()."""
    forward: comm.Route
    exact: comm.Route
    node: comm.Route | None = None


class Unit:
    """One unit: its module, its buffers, its state, and what each hook does to it.

    full [Ψ_u padded]  its trainable parameters end to end: 0 bytes while FREE (shape kept),
                       allocated while IN_FLIGHT / GATHERED, when the parameters are views of it.
    shard [Ψ_u / N]    this rank's partition, a view into param_shard: all that persists.
    frozen_full, frozen_shard: the same for its frozen parameters; secondary: hpZ's [Ψ_u / R].
    training_state     IDLE -pre_forward-> FORWARD -post_forward-> IDLE; engine.backward() ->
                       PRE_BACKWARD -post_backward-> IDLE (a forward in PRE_BACKWARD recomputes).
    """

    def __init__(self, engine, module, name: str, index: int, routes: UnitRoutes, bucket,
                 buffers: list[tuple[torch.Tensor, torch.Tensor]], frozen_bucket):
        self.engine, self.module, self.name, self.index = engine, module, name, index
        self.routes, self.bucket, self.frozen_bucket = routes, bucket, frozen_bucket
        self.tag = f"unit {index} ({name})"           # what its collectives are for (event stream)
        (self.full, self.shard), (self.frozen_full, self.frozen_shard) = buffers
        self.params = [p for b in (bucket, frozen_bucket) if b is not None for p in b.params]
        self.numel = sum(p.numel() for p in self.params)
        # [Note: absent parameters] what each parameter is while GATHERED (built so: flat.py) and
        # while not
        self.views = [p.data for p in self.params]
        self.absent = [absent_like(p) for p in self.params]
        self.state, self.training_state = GATHERED, IDLE
        self.held = False                  # engine.gathered() holds it: forward does not free it
        self.secondary: list[torch.Tensor] | None = None
        self._in_flight: list = []                     # all-gather handles while IN_FLIGHT
        self.free()                                    # built gathered; released right away

    def buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(full, shard) for its trainable and its frozen parameters, those it has."""
        pairs = (self.full, self.shard), (self.frozen_full, self.frozen_shard)
        return [(full, shard) for full, shard in pairs if full.numel()]

    def held_bytes(self) -> int:
        return sum(full.untyped_storage().nbytes() for full, _ in self.buffers())

    def gather(self, prefetch: bool = False, forward: bool = False) -> None:
        """FREE -> IN_FLIGHT -> GATHERED: all-gather `full` from the shards (prefetch: start)."""
        if self.state == GATHERED or (self.state == IN_FLIGHT and prefetch):
            return
        if self.state == FREE:
            route, sources = self._route(forward)
            for (full, _), source in zip(self.buffers(), sources):
                full.untyped_storage().resize_(full.numel() * full.element_size())   # allocate
                # <- the essential line of stage 3: every rank's partition -> the full unit
                self._in_flight.append(route.all_gather(full, source, self.tag))
            self.state = IN_FLIGHT
            events.emit("unit gather", engine=self.engine, unit=self, prefetch=prefetch,
                        nbytes=self.held_bytes())
            if prefetch:
                return
        self._wait()
        self.state = GATHERED
        self.point_params(gathered=True)
        if self.routes.node is not None and self.training_state == FORWARD:
            self.keep_secondary()
        events.emit("unit gathered", engine=self.engine, unit=self)

    def point_params(self, gathered: bool) -> None:
        """The module's parameters: views of `full` while it is gathered (the module computes with
        them), absent otherwise ([Note: absent parameters])."""
        for p, view, absent in zip(self.params, self.views, self.absent):
            p.data = view if gathered else absent
            refuse_writes(p, not gathered)

    def _route(self, forward: bool) -> tuple[comm.Route, list[torch.Tensor]]:
        """Backward's all-gather runs within the node from the secondaries when hpZ kept them."""
        if self.training_state == PRE_BACKWARD and self.secondary is not None:
            return self.routes.node, self.secondary
        route = self.routes.forward if forward else self.routes.exact
        return route, [shard for _, shard in self.buffers()]

    def _wait(self) -> None:
        for handle in self._in_flight:
            handle.wait()
        self._in_flight = []

    def free(self) -> None:
        """Release `full` (0 bytes); the parameters become absent (see absent_like)."""
        if self.state == FREE:
            return
        self._wait()                                   # never free a buffer a collective is writing
        nbytes = self.held_bytes()
        self.point_params(gathered=False)
        for full, _ in self.buffers():
            full.untyped_storage().resize_(0)
        self.state = FREE
        events.emit("unit freed", engine=self.engine, unit=self, nbytes=-nbytes)

    def keep_secondary(self) -> None:
        """[Note: hpZ]: keep this rank's 1/R of the full unit, its slice within the node's group."""
        group = self.routes.node.group
        self.drop_secondary()
        self.secondary = [partition(full, comm.group_rank(group), comm.group_size(group)).clone()
                          for full, _ in self.buffers()]
        events.emit("secondary", engine=self.engine, unit=self,
                    nbytes=sum(t.nbytes for t in self.secondary))

    def drop_secondary(self) -> None:
        if self.secondary is not None:
            events.emit("secondary", engine=self.engine, unit=self,
                        nbytes=-sum(t.nbytes for t in self.secondary))
        self.secondary = None

    def reduce_scatter_grads(self):
        """Stage 2's reduce-scatter of its gradients (Zero2.reduce_scatter_grads); the handle."""
        return self.engine.reduce_scatter_grads(self.bucket)

    # --- lifecycle: Zero3 calls these from the module's forward hooks and from autograd -----------
    def pre_forward(self) -> None:
        if self.training_state == PRE_BACKWARD:        # backward recomputes it [Note: recompute]
            self.gather()                              # reentrant: its first use in this backward
            return
        self.training_state = FORWARD
        self.gather(forward=True)
        self.engine.prefetch_after(self, forward=True)

    def post_forward(self) -> None:
        if self.training_state == PRE_BACKWARD:     # a recompute: its backward needs the parameters
            return
        self.training_state = IDLE
        if not self.held:
            self.free()                                # <- stage 3's saving: free after forward

    def pre_backward(self) -> None:
        """Its output's gradient is known: its backward is next, every later unit's is done."""
        self.engine.free_finished()
        self.training_state = PRE_BACKWARD
        self.gather()
        self.engine.prefetch_after(self, forward=False)

    def post_backward(self):
        """Its trainable gradients are complete: reduce-scatter them, free it; the handle. A unit
        with frozen parameters may still need them (the input's gradient can flow through a frozen
        weight after the last trainable gradient, as LoRA's does): it is freed later."""
        handle = self.reduce_scatter_grads()
        self.training_state = IDLE
        self.drop_secondary()                          # hpZ: its backward all-gather is done
        if self.frozen_bucket is None:
            self.free()
        else:
            self.engine.finished.append(self)          # freed by the next pre_backward, or the end
        return handle
