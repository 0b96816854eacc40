"""Grader for exercise 10 (the global overflow check of fp16 loss scaling):  pytest exercises -k
ex10

The adapter: LossScaler.found_overflow is the seam where minizero's loss scaler asks whether the
step's gradients overflowed on any rank (loss_scale.py). A thin subclass calls your found_overflow
there; the same subclass's unscale puts the fault into the gradients first: an inf into one element
of rank 1's partition at step 1, a nan into rank 0's at step 2 (the grader's doing, not minizero's).
One launch of two ranks trains a small GPT in fp16 at stage 3 twice: with your check, then with
minizero's. Every rank must decide as minizero's check does at every step (skip steps 1 and 2
everywhere), and end bit-identical to it.
"""

import pytest
import torch

import _grading as g
import minizero
from minizero import comm
from minizero.lab.train import train_worker
from minizero.loss_scale import LossScaler

# Stage 3: a skipped step sends no collective there, so ranks that disagree diverge instead of
# hanging. Hysteresis 2: the first overflow (step 1) only uses up a credit, the second (step 2)
# halves the scale.
CFG = g.config(stage=3, world_size=2, steps=4, dtype="fp16",
               loss_scale={"initial_scale_power": 10, "hysteresis": 2})
# step: (rank whose partition gets it, value)
FAULTS = {1: (1, float("inf")), 2: (0, float("nan"))}


class GradedScaler(LossScaler):
    """minizero's loss scaler with a fault injected into one rank's partition and `check` as its
    overflow check; it records each step's decision and the scale after it."""

    def __init__(self, loss_scale, check):
        super().__init__(loss_scale)
        self.check, self.decisions, self.scales = check, [], []

    def unscale(self, grads):
        rank, value = FAULTS.get(self.iteration, (None, None))
        if comm.rank() == rank:
            grads[0].view(-1)[0] = value                     # this rank's partition only
        out = super().unscale(grads)
        self.scales.append(self.scale)
        return out

    def found_overflow(self, grads):
        answer = g.call(self.check, grads)
        if not isinstance(answer, (bool, torch.Tensor)) or (
            torch.is_tensor(answer) and answer.numel() != 1
        ):
            raise AssertionError(f"rank {comm.rank()}: found_overflow returned {answer!r}, "
                                 "expected a bool")
        self.decisions.append(bool(answer))
        return bool(answer)


def run(check) -> dict:
    scalers = [GradedScaler(CFG.loss_scale, check)]

    def build(model, stage, optimizer, **options):
        # a LossScaler given as loss_scale is the engine's scaler (minizero/loss_scale.py)
        return minizero.wrap(model, stage, optimizer, **{**options, "loss_scale": scalers[-1]})

    result = train_worker(CFG, make_engine=build)
    return {
        "rank": result["rank"],
        "state_dict": result["state_dict"],
        "decisions": scalers[-1].decisions,
        "scales": scalers[-1].scales,
    }


def worker(module_name: str) -> dict:
    answer = g.learner(module_name)
    # yours first: a failing answer fails fast
    yours = run(answer.found_overflow)
    return {
        "rank": comm.rank(),
        "yours": yours,
        "minizero": run(LossScaler(CFG.loss_scale).found_overflow),
    }


def launched(impl: str) -> list[dict]:
    """The ranks' results for impl; one launch serves every test of this grader
    (_grading.launch_once)."""
    return g.launch_once(worker, CFG.world_size, impl)


def check_decisions(impl: str) -> None:
    __tracebackhide__ = True
    g.guard(impl)
    ranks = launched(impl)
    for res in ranks:
        ref = res["minizero"]["decisions"]
        assert all(ref[k] for k in FAULTS), ("grader: minizero's own check did not skip the "
                                             "injected steps")
        for step, (got, expected) in enumerate(zip(res["yours"]["decisions"], ref)):
            if got == expected:
                continue
            if step in FAULTS:
                rank, value = FAULTS[step]
                # did the rank holding it see it?
                seen_there = ranks[rank]["yours"]["decisions"][step]
                why = (f"rank {rank}'s partition held a {value} at that step" +
                       (" (you found it only on that rank: combine the ranks' flags with one "
                        "collective)"
                        if seen_there else " (a nan is an overflow too: torch.isfinite catches "
                                           "both)"))
            else:
                why = "no rank's partition held an inf or a nan at that step"
            raise AssertionError(f"rank {res['rank']}, step {step}: your found_overflow returned "
                                 f"{got}, expected {expected}: {why}. Every rank must take the "
                                 "same decision.")


def check_training(impl: str) -> None:
    __tracebackhide__ = True
    g.guard(impl)
    ranks = launched(impl)
    for res in ranks:
        yours, ref = res["yours"], res["minizero"]
        for name, expected in ref["state_dict"].items():
            got = yours["state_dict"][name]
            if not torch.equal(got, expected):
                diff = (got.double() - expected.double()).abs().max().item()
                raise AssertionError(f"rank {res['rank']}, {name}: after {CFG.steps} fp16 steps "
                                     f"your run differs from minizero's by up to {diff:.3g} (nan: "
                                     "a nan was stepped into the parameters). Did every rank skip "
                                     "the overflowed steps?")
        if yours["scales"] != ref["scales"]:
            raise AssertionError(f"rank {res['rank']}: loss scales after each step "
                                 f"{yours['scales']}, minizero's {ref['scales']}")


@pytest.mark.points(2)
def test_every_rank_agrees_on_an_overflow_in_one_partition(impl):
    check_decisions(impl)


@pytest.mark.points(1)
def test_fp16_run_with_injected_overflows_matches_minizero(impl):
    check_training(impl)
