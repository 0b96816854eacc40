"""Grader for exercise 9 (offloaded optimizer step):  pytest exercises -k ex09

A thin subclass of minizero's HostShardOptimizer (homes.HostHome: it checkpoints) calls your
offload_step and then checks the host gradient buffers and the copy back; minizero's stage 2 with
offload uses it while two ranks train, and the result is compared with one process training on the
whole batch.
"""

from dataclasses import replace

import pytest
import torch

import _grading as g
from minizero import comm
from minizero.homes import HostHome
from minizero.assembled import Zero2

CFG = g.config(stage=2, world_size=2, offload=True)


class LearnerHostOptimizer(HostHome):
    """minizero's host optimizer with the learner's offload_step as its step, checked after each
    one."""
    answer = None                                 # the learner's module, set by the worker
    steps = 0

    def step(self, grad_parts):
        self.steps += 1
        self.answer.offload_step(self, grad_parts)
        for i, (grad, host, master, part) in enumerate(
            zip(grad_parts, self.host_grads, self.masters, self.param_parts)
        ):
            where = f"rank {comm.rank()}, step {self.steps}, bucket {i}"
            if not torch.equal(host, grad.float().cpu()):
                raise AssertionError(f"{where}: host_grads[{i}] does not hold the averaged "
                                     f"gradient grad_parts[{i}]: copy the device gradients into "
                                     "the host buffers and step on those")
            rounded = master.detach().to(part.dtype).to(part.device)
            if not torch.equal(part, rounded):
                diff = (part.double() - rounded.double()).abs().max().item()
                raise AssertionError(f"{where}: the device parameters param_parts[{i}] differ from "
                                     f"the updated masters[{i}] by up to {diff:.3g}: copy the "
                                     "masters back")


class LearnerOffloadZero2(Zero2):
    """minizero's stage 2 (offload=True), its row of the table with the learner's host optimizer."""
    row = replace(Zero2.row, optimizer=lambda parts, factory, grouping, placement:
                  LearnerHostOptimizer(parts, factory))


def worker(module_name: str) -> dict:
    LearnerHostOptimizer.answer = g.learner(module_name)
    return g.train_with(LearnerOffloadZero2, CFG)


def check_training(impl: str) -> None:
    g.guard(impl)
    g.assert_matches_reference(CFG, g.launch(worker, CFG.world_size, impl),
                               hint="Does the optimizer step the host masters with the host "
                                    "gradients?")


@pytest.mark.points(2)
def test_offloaded_step_trains_like_one_process(impl):
    check_training(impl)
