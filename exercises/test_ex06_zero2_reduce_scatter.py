"""Grader for exercise 6 (ZeRO-2 reduce-scatter in the backward hook):  pytest exercises -k ex06

A thin subclass of minizero's stage 2 calls your hook for every finished bucket instead of its own,
while three ranks train; the result is compared with one process training on the whole batch.
"""

import dataclasses

import pytest

import _grading as g
from minizero import comm
from minizero.assembled import Zero2
from minizero.zero2 import GradientShard

# bucket_size 3000 bytes: several buckets, each padded
CFG = g.config(stage=2, world_size=3)


class LearnerGradients(GradientShard):
    """minizero's stage 2 gradients with the learner's hook in place of GradientShard.reduce."""
    answer = None                                 # the learner's module, set by the worker
    # p.grad stays until the hook: it stages the whole bucket
    contiguous_gradients = False

    def reduce(self, b, tag=None):
        if not self.engine.sync:
            return None                           # inside no_sync(): p.grad keeps accumulating
        staging, handle = self.answer.reduce_scatter_bucket(list(b.params), b.padded_numel)
        where = (f"rank {comm.rank()}, bucket {b.index} ({b.numel} elements, padded to "
                 f"{b.padded_numel})")
        names = {id(p): n for n, p in self.engine.module.named_parameters()}
        kept = [names[id(p)] for p in b.params if p.grad is not None]
        if kept:
            raise AssertionError(f"{where}: p.grad of {kept[0]} is still set after your hook: free "
                                 "the full gradients (p.grad = None), that is the memory stage 2 "
                                 "saves")
        if staging.numel() != b.padded_numel:
            raise AssertionError(f"{where}: staging buffer has {staging.numel()} elements, "
                                 f"expected {b.padded_numel}: one partition of {b.shard_numel} per "
                                 "rank")
        # when handle completes, minizero adds my partition of it
        self.staging[b.index] = staging
        return handle


class LearnerZero2(Zero2):
    row = dataclasses.replace(Zero2.row, gradients=LearnerGradients)  # stage 2, the learner's P_g


def worker(module_name: str, cfg=CFG) -> dict:
    LearnerGradients.answer = g.learner(module_name)
    return g.train_with(LearnerZero2, cfg)


def check_training(impl: str) -> None:
    g.guard(impl)
    try:
        g.assert_matches_reference(CFG, g.launch(worker, CFG.world_size, impl),
                                   hint="Is each bucket's gradient averaged over ranks (not "
                                        "summed), each parameter copied at its offset, and "
                                        "partition r reduced onto rank r?")
    except AssertionError as wrong:
        if "x the reference's" not in str(wrong):        # not a wrong update: nothing to measure
            raise
        # over several SGD steps a gradient c times too large does not show as c: each later step's
        # gradient is taken where the earlier, too large steps left the parameters. One step does.
        one = dataclasses.replace(CFG, steps=1)
        ratio = g.first_step_ratio(one, g.launch(worker, CFG.world_size, impl, one))
        n = CFG.world_size
        why = (f": exactly N = {n}, a sum over the ranks where their average belongs (op avg)"
               if abs(ratio - n) < 0.01 * n else "")
        raise AssertionError(f"{wrong} (After {CFG.steps} steps the ratio is not a clean "
                             "multiple: each step's gradient is taken where the previous steps "
                             f"left the parameters. One step alone: {ratio:.3g} x the reference's "
                             f"update{why}.)") from None


@pytest.mark.points(3)
def test_zero2_with_your_hook_trains_like_one_process(impl):
    check_training(impl)
