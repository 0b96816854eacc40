"""What the units under one `fully_shard` root share: their order, the forward under way, the
reduce-scatter in flight, and the end of backward (FSDP2's state context).

    python -m pytest tests/test_fully_shard.py tests/test_fully_shard_scenarios.py

Every unit (fsdp_unit.py) starts with a Root of its own. The first forward through a unit that no
root has adopted makes it the root: its Root adopts every unit at or below its module (names and
numbers them in module order: "unit 0 (<root>)", "unit 1 (blocks.0)", ...), and from then on they
share it. It records the first forward's order (the next unit to prefetch in forward) and each
iteration's post-forward order (backward prefetches the unit that ran before); it queues
finish_backward on autograd's engine when backward starts (torch's DDP and FSDP do the same: the
user writes loss.backward() and nothing else), where every unit is reduced, every reduce-scatter
finished, every unit left idle.
"""

from __future__ import annotations

import torch
from torch import nn

from minizero.pytorch.fsdp_reduce import Reduction
from minizero.pytorch.fsdp_unit import ShardState, TrainingState, Unit


class Root:
    """What the units under one root module share for an iteration (FSDP2's state context): their
    order, the forward under way, the reduce-scatter in flight, the end of backward. Every unit
    has its own until the first forward through it, when the outermost one adopts the others."""

    def __init__(self, module: nn.Module, units: list[Unit]):
        self.module, self.units = module, units
        self.started = False
        self.forward_order: list[Unit] = []     # the root's first forward's pre-forward order
        self.recorded = False                   # ... once that forward has ended
        self.post_forward_order: list[Unit] = []   # this iteration's: backward prefetches back
        self.iteration_root: Unit | None = None    # the unit whose forward began this one
        self.pending: list[Reduction] = []         # the reduce-scatter in flight
        self.callback_queued = False
        self.is_last_backward = True               # set_is_last_backward

    def start(self) -> None:
        """The first forward: adopt every unit at or below this module, in module order (a unit
        of several modules where the first of them is)."""
        if len(self.units[0].modules) > 1:
            raise RuntimeError("fully_shard: a unit of several modules cannot be the root: "
                               "fully_shard their common parent too")
        names: dict[int, list[str]] = {}
        units: list[Unit] = []
        for name, m in self.module.named_modules():
            unit = getattr(m, "_fsdp_unit", None)
            if unit is not None:
                if id(unit) not in names:
                    units.append(unit)
                names.setdefault(id(unit), []).append(name)
        for unit in units:
            if unit.tied_apart:
                raise ValueError(unit.tied_apart[0])
        for unit in units[1:]:
            if unit.root.started:
                raise RuntimeError(f"fully_shard: {names[id(unit)][0]} ran forward before its "
                                   f"root {type(self.module).__name__}: run the root's forward "
                                   "first")
        self.units = units
        for index, unit in enumerate(units):
            unit.adopt(self, index, names[id(unit)], is_root=index == 0)
        self.started = True

    # --- forward ----------------------------------------------------------------------------------
    def forward_starts(self, unit: Unit) -> None:
        if self.iteration_root is None:
            self.iteration_root = unit
        if (self.iteration_root is self.units[0] and not self.recorded
                and unit not in self.forward_order):
            self.forward_order.append(unit)

    def ran_forward(self, unit: Unit) -> int:
        """Its post-forward: where it stands in this iteration's order."""
        self.post_forward_order.append(unit)
        return len(self.post_forward_order) - 1

    def forward_ends(self, unit: Unit, output) -> None:
        """A unit's forward ended; if it began this one: a unit some of whose modules did not run
        ends now, on this output (FSDP2's partial forward of a group), and a prefetch this
        forward did not use is dropped."""
        if unit is self.iteration_root:
            self.recorded = self.recorded or unit is self.units[0]
            self.iteration_root = None
            for u in self.units:
                if u.training_state == TrainingState.FORWARD:
                    u.end_forward(output)
                if u.state == ShardState.IN_FLIGHT:
                    u.free()

    def prefetch_targets(self, unit: Unit, forward: bool) -> list[Unit]:
        """Which units to start gathering now: set_modules_to_*_prefetch's, else the next in the
        first forward's order (forward) or the one that ran before it (backward)."""
        explicit = unit.forward_prefetch if forward else unit.backward_prefetch
        if explicit is not None:
            return explicit
        if forward:
            order = self.forward_order
            at = order.index(unit) + 1 if unit in order else len(order)
            useful = self.recorded and self.iteration_root is self.units[0]
            return order[at:at + 1] if useful else []
        if not unit.post_forward_indices:
            return []
        at = unit.post_forward_indices.pop()
        return [self.post_forward_order[at - 1]] if at > 0 else []

    # --- backward ---------------------------------------------------------------------------------
    def backward_starts(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def reduce(self, reduction: Reduction) -> None:
        """A unit's reduce-scatter started (fsdp_reduce.py): finish the one before it."""
        self.finish_reductions()
        self.pending.append(reduction)

    def finish_reductions(self) -> None:
        while self.pending:
            self.pending.pop(0).finish()

    def reset(self) -> None:
        """After a forward or backward that raised (FSDPModule.reset_iter_state): the
        reduce-scatter in flight waited for and dropped, every unit reset, the orders cleared."""
        for reduction in self.pending:
            reduction.handle.wait()
        self.pending, self.iteration_root, self.callback_queued = [], None, False
        for unit in self.units:
            unit.reset()
        self.post_forward_order.clear()

    def finish_backward(self) -> None:
        """The end of loss.backward() (an autograd-engine callback): reduce what no input hook
        reduced (the root's parameters, a unit fed no gradient-carrying input), finish every
        reduce-scatter, and leave every unit idle."""
        for unit in reversed(self.units):
            if unit.training_state != TrainingState.POST_BACKWARD:
                unit.post_backward()
        self.finish_reductions()
        for unit in self.units:
            unit.end_backward()
            unit.reset_iteration(self.is_last_backward)
        if self.is_last_backward:
            self.post_forward_order.clear()
        self.callback_queued = False
