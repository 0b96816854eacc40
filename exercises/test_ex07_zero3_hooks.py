"""Grader for exercise 7 (ZeRO-3 hooks):  pytest exercises -k ex07

minizero's stage 3 (prefetch on) is given a Unit class whose four lifecycle hooks are yours, and
checks before each one whether the unit was prefetched, after each one whether it is materialized or
released, and that your hooks never call minizero's own unit.gather() / unit.free(); three ranks
train and are compared with one process training on the whole batch.
"""

import dataclasses

import pytest

import _grading as g
from minizero import comm, events
from minizero.assembled import Zero3
from minizero.units import ModelUnit, ModelUnits

# No frozen parameter here: minizero keeps a unit's frozen parameters in a second buffer
# (unit.frozen_full) that this exercise leaves out; the unused parameter and the odd sizes stay.
CFG = g.config(stage=3, world_size=3, model_overrides={"unused_param": True})
_inside: list[str] = []            # the learner hook running now (the grader's own bookkeeping)


class LearnerUnit(ModelUnit):
    """minizero's unit (units.ModelUnit: zero3.Unit as wrap uses it) with the learner's four hooks
    as its lifecycle (its family still wires them to the model's forward hooks and to autograd);
    checks around each one that the unit was prefetched and is gathered or freed, and that the
    learner's hooks leave minizero's gather() and free() alone."""
    answer = None                                 # the learner's module, set by the worker
    units = None                                  # the engine's ShardedUnits: the recorded orders
    steps = 0                                     # steps taken (the event stream's "step")

    def pre_forward(self):
        # the order is recorded during the first step's forward; from the second step on it is known
        order = self.units.forward_order if self.steps else []
        self._graded("pre_forward", gathered=True, order=order)

    def post_forward(self, keep=False):
        self._graded("post_forward", gathered=False)

    def pre_backward(self):
        self._graded("pre_backward", gathered=True, order=self.units.backward_order)

    def post_backward(self, reduce_scatter):
        self._reduce_scatter = reduce_scatter     # what reduce_scatter_grads() below calls
        return self._graded("post_backward", gathered=False)

    def reduce_scatter_grads(self):
        """Stage 2's reduce-scatter of this unit's gradients (GradientShard.reduce); the handle."""
        return self._reduce_scatter(self.bucket, self.tag)

    def gather(self, *args, **kwargs):
        self._refuse("gather")
        super().gather(*args, **kwargs)           # the engine's own uses (full_state_dict) stay

    def free(self):
        self._refuse("free")
        super().free()

    def _refuse(self, method: str) -> None:
        if _inside:
            raise AssertionError(f"rank {comm.rank()}, {_inside[-1]}: your hook called unit."
                                 f"{method}(), minizero's own answer: resize the storage and call "
                                 "comm.all_gather yourself")

    def _graded(self, hook: str, gathered: bool, order: list | None = None):
        where = f"rank {comm.rank()}, unit {self.name!r}, {hook}"
        size = self.full.numel() * self.full.element_size()
        args = (self,)
        # a pre_ hook: which unit comes next, prefetched by it
        if order is not None:
            at = order.index(self) if self in order else len(order)
            if 0 < at < len(order) and self.full.untyped_storage().nbytes() < size:
                raise AssertionError(f"{where}: this unit was not prefetched: its all-gather had "
                                     f"not been started when its hook began; {order[at - 1].name!r}"
                                     f"'s {hook} got it as `following` and should have started it "
                                     "(async_op=True)")
            args += (order[at + 1] if at + 1 < len(order) else None,)
        _inside.append(f"unit {self.name!r}, {hook}")
        try:
            result = getattr(self.answer, hook)(*args)
        finally:
            _inside.pop()
        held = self.full.untyped_storage().nbytes()
        if gathered and held < size:
            raise AssertionError(f"{where}: after it, its parameters are not materialized ({held} "
                                 f"of {size} bytes): re-allocate unit.full's storage and "
                                 "all-gather the shards into it")
        if not gathered and held:
            raise AssertionError(f"{where}: after it, unit.full still holds {held} bytes: release "
                                 "it (resize its storage to 0), that is the memory stage 3 saves")
        self.point_params(gathered)       # the module computes with unit.full, or sees it absent
        return result


class LearnerUnits(ModelUnits):
    unit_class = LearnerUnit

    def __init__(self, *args):
        super().__init__(*args)
        LearnerUnit.units = self


class LearnerZero3(Zero3):
    row = dataclasses.replace(Zero3.row, parameters=LearnerUnits)  # stage 3's row, learner's units


def count_steps(name: str, fields: dict) -> None:
    LearnerUnit.steps += name == "step"


def worker(module_name: str) -> dict:
    LearnerUnit.answer = g.learner(module_name)
    with events.subscribed(count_steps):
        return g.train_with(LearnerZero3, CFG)


def check_training(impl: str) -> None:
    g.guard(impl)
    g.assert_matches_reference(CFG, g.launch(worker, CFG.world_size, impl),
                               hint="Do you all-gather into unit.full in place, wait for each "
                                    "handle before the unit computes, and does post_backward call "
                                    "unit.reduce_scatter_grads()?")


@pytest.mark.points(3)
def test_zero3_with_your_hooks_trains_like_one_process(impl):
    check_training(impl)
