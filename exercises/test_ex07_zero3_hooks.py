"""Grader for exercise 7 (ZeRO-3 hooks):  pytest exercises -k ex07

minizero's stage 3 (prefetch off) is given a Unit class whose four lifecycle hooks are yours, and checks
after each one whether the unit is materialized or released; three ranks train and are compared with one
process training on the whole batch.
"""

import pytest

import _grading as g
from minizero.zero3 import Unit, Zero3

# No frozen parameter here: minizero keeps a unit's frozen parameters in a second buffer (unit.frozen_full)
# that this exercise leaves out; the unused parameter and the odd sizes stay.
CFG = g.config(stage=3, world_size=3, prefetch=False, model_overrides={"unused_param": True})


class LearnerUnit(Unit):
    """minizero's unit with the learner's four hooks as its lifecycle (Zero3 still wires them to the
    model's forward hooks and to autograd); after each one, checks that the unit is gathered or freed."""
    answer = None                                 # the learner's module, set by the worker

    def pre_forward(self):
        self._graded("pre_forward", gathered=True)

    def post_forward(self):
        self._graded("post_forward", gathered=False)

    def pre_backward(self):
        self._graded("pre_backward", gathered=True)

    def post_backward(self):
        return self._graded("post_backward", gathered=False)

    def _graded(self, hook: str, gathered: bool):
        result = getattr(self.answer, hook)(self)
        held, size = self.full.untyped_storage().nbytes(), self.full.numel() * self.full.element_size()
        where = f"rank {self.engine.rank}, unit {self.name!r}, after {hook}"
        if gathered and held < size:
            raise AssertionError(f"{where}: its parameters are not materialized ({held} of {size} bytes): "
                                 "re-allocate unit.full's storage and all-gather the shards into it")
        if not gathered and held:
            raise AssertionError(f"{where}: unit.full still holds {held} bytes: release it (resize its "
                                 "storage to 0), that is the memory stage 3 saves")
        return result


class LearnerZero3(Zero3):
    unit_class = LearnerUnit


def worker(module_name: str) -> dict:
    LearnerUnit.answer = g.learner(module_name)
    return g.train_with(LearnerZero3, CFG)


def check_training(impl: str) -> None:
    g.guard(impl)
    g.assert_matches_reference(CFG, g.launch(worker, CFG.world_size, impl),
                               hint="Do you all-gather into unit.full in place, and does post_backward "
                                    "call unit.reduce_scatter_grads()?")


@pytest.mark.points(3)
def test_zero3_with_your_hooks_trains_like_one_process(impl):
    check_training(impl)
