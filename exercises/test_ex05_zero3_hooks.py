"""Grader for exercise 5 (ZeRO-3 hooks):  pytest exercises -k ex05

A thin subclass of minizero's stage 3 (prefetch off) calls your four hooks where its own gather and free
would run and checks, after each one, whether the unit is materialized or released; three ranks train
and are compared with one process training on the whole batch.
"""

from dataclasses import dataclass
from functools import partial
from typing import Callable

import pytest
import torch

import _grading as g
from minizero.zero2 import Zero2
from minizero.zero3 import FREE, GATHERED, Zero3

CFG = g.config(stage=3, world_size=3, prefetch=False)


@dataclass
class Unit:
    """What a hook is given (see the exercise's statement)."""
    name: str
    full: torch.Tensor
    shard: torch.Tensor
    reduce_scatter_grads: Callable


class LearnerZero3(Zero3):
    """minizero's stage 3 with the learner's hooks in place of its gather and free."""
    answer = None                                 # the learner's module, set by the worker
    _in_post_forward = False

    def _hook(self, name: str, b, gathered: bool):
        full = self.full_params[b.index]
        result = getattr(self.answer, name)(Unit(self.unit_names[b.index], full,
                                                 self.layout.shard(self.param_shard, b),
                                                 partial(Zero2._reduce_scatter_bucket, self, b)))
        held, size = full.untyped_storage().nbytes(), full.numel() * full.element_size()
        where = f"rank {self.rank}, unit {self.unit_names[b.index]!r}, after {name}"
        if gathered and held < size:
            raise AssertionError(f"{where}: its parameters are not materialized ({held} of {size} bytes): "
                                 "re-allocate unit.full's storage and all-gather the shards into it")
        if not gathered and held:
            raise AssertionError(f"{where}: unit.full still holds {held} bytes: release it (resize its "
                                 "storage to 0), that is the memory stage 3 saves")
        self._state[b.index] = GATHERED if gathered else FREE
        return result

    def _pre_forward(self, b, module, args):
        self._hook("pre_forward", b, gathered=True)

    def _post_forward(self, b, module, args, output):
        # Zero3's own _post_forward registers the pre-backward hooks on the outputs and then frees the unit:
        # keep the first, route the second (its call to self._free) to the learner's post_forward.
        self._in_post_forward = True
        try:
            super()._post_forward(b, module, args, output)
        finally:
            self._in_post_forward = False

    def _free(self, b):
        if self._in_post_forward:
            self._hook("post_forward", b, gathered=False)
        else:
            super()._free(b)                      # at construction, and units whose backward never ran

    def _pre_backward(self, b, grad):
        self._hook("pre_backward", b, gathered=True)

    def _reduce_scatter_bucket(self, b):
        return self._hook("post_backward", b, gathered=False)


def worker(module_name: str) -> dict:
    LearnerZero3.answer = g.learner(module_name)
    return g.train_with(LearnerZero3, CFG)


def check_training(impl: str) -> None:
    g.assert_matches_reference(CFG, g.launch(worker, CFG.world_size, impl),
                               hint="Do you all-gather into unit.full in place, and does post_backward "
                                    "call unit.reduce_scatter_grads()?")


@pytest.mark.points(3)
def test_zero3_with_your_hooks_trains_like_one_process(impl):
    check_training(impl)
