"""Grader for exercise 4 (ZeRO-1 partitions and the all-gather):  pytest exercises -k ex04

Your padding and partitions are compared with minizero.flat's arithmetic; then a thin subclass of
minizero's stage 1 lets your partition choose what each rank's optimizer steps and your all-gather
share it, while three ranks train and are compared with one process training on the whole batch.
"""

from dataclasses import replace

import pytest

import _grading as g
from minizero import comm
from minizero.flat import padded_size
from minizero.ddp import ReplicatedParameters
from minizero.assembled import Zero1
from minizero.zero1 import GradientsReducedAtStep

CFG = g.config(stage=1, world_size=3)            # the tiny GPT's Ψ is not a multiple of 3: padding

# Ψ values: fewer elements than ranks, exact multiples, one short of a multiple, the tiny GPT's
# size.
NUMELS = [1, 2, 7, 15, 16, 4703]
WORLD_SIZES = [1, 2, 3, 4, 8]


class Learner:
    answer = None                                 # the learner's module, set by the worker


def mine(layout, flat, b):
    """The learner's partition of bucket b of a flat buffer: what this rank owns."""
    n, rank = comm.world_size(), comm.rank()
    start, end = Learner.answer.partition(b.numel, n, rank)
    if end - start != b.shard_numel:
        raise AssertionError(
            f"rank {rank}: partition({b.numel}, {n}, {rank}) = ({start}, {end}) is {end - start} "
            f"elements; every rank owns padded_numel / N = {b.shard_numel}")
    return layout.full(flat, b)[start:end]


class LearnerParameters(ReplicatedParameters):
    """Stage 1's parameters with the learner's partition (what this rank steps) and all-gather."""

    def optimizer_parts(self):
        return [mine(self.layout, self.flat, b) for b in self.layout.buckets]

    def after_step(self):
        for b in self.layout.buckets:
            Learner.answer.all_gather_params(self.layout.full(self.flat, b))


class LearnerGradients(GradientsReducedAtStep):
    def parts(self):
        # minizero's reduce-scatter: partition r gets the average; the learner's partition of it
        super().parts()
        return [mine(self.layout, self.flat, b) for b in self.layout.buckets]


class LearnerZero1(Zero1):
    """minizero's stage 1, its row of the table with the learner's partitions."""
    row = replace(Zero1.row, parameters=LearnerParameters, gradients=LearnerGradients)


def worker(module_name: str) -> dict:
    Learner.answer = g.learner(module_name)
    return g.train_with(LearnerZero1, CFG)


def check_partitions(impl: str) -> None:
    g.guard(impl)
    answer = g.learner(impl)
    for numel in NUMELS:
        for n in WORLD_SIZES:
            padded = padded_size(numel, n)
            got = g.call(answer.padded_numel, numel, n)
            if got != padded:
                raise AssertionError(f"padded_numel({numel}, {n}) = {got}, expected {padded}: the "
                                     f"smallest multiple of {n} that is at least {numel}")
            size = padded // n
            for r in range(n):
                got = tuple(g.call(answer.partition, numel, n, r))
                if got != (r * size, (r + 1) * size):
                    raise AssertionError(
                        f"partition({numel}, {n}, {r}) = {got}, expected "
                        f"{(r * size, (r + 1) * size)}: the padded buffer of {padded} elements cut "
                        f"into {n} partitions of {size}"
                        + (
                            " (did you forget the padding?)"
                            if got[1] - got[0] == numel // n
                            else ""
                        )
                    )


def check_training(impl: str) -> None:
    g.guard(impl)
    g.assert_matches_reference(CFG, g.launch(worker, CFG.world_size, impl),
                               hint="Does each rank step exactly its partition, and does the "
                                    "all-gather give every rank every partition after the step?")


@pytest.mark.points(1)
def test_padding_and_partitions(impl):
    check_partitions(impl)


@pytest.mark.points(2)
def test_zero1_with_your_partition_and_all_gather_trains_like_one_process(impl):
    check_training(impl)
