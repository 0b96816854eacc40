"""Grader for exercise 11 (activation checkpointing of a unit):  pytest exercises -k ex11

The adapter: after minizero's stage 2 engine is built, each transformer block's forward becomes
checkpoint(run, x), your function, where `run` is the block's own forward, recorded by the engine's
saved-tensor meter whenever it runs (as minizero's own recompute is). One launch of two ranks trains
the same 4-block GPT three times: without checkpointing, with minizero's (for the message), and with
yours. Yours must end where one process training on the whole batch ends, and its peak of saved
activations must be at most half of the run's without checkpointing.
"""

import dataclasses
from functools import partial

import pytest
import torch

import _grading as g
from minizero import comm
from minizero.lab.train import train_worker
from minizero.assembled import Zero2

REFUSED = ("torch.utils.checkpoint",)           # PyTorch's checkpointing is the answer too

# Four blocks: the rest of the model (embeddings, final LayerNorm, head, loss) keeps its activations
# with or without checkpointing, and with the tiny model's two blocks it would weigh too much for
# the ≤ 50 % that the paper's deep models clear easily.
CFG = g.config(stage=2, world_size=2,
               model_overrides={"frozen": ("pos_emb.weight",), "unused_param": True, "n_layer": 4})
MAX_FRACTION = 0.5


def checkpointed(answer, meter, name: str, forward, x):
    """A block's forward, through the learner's checkpoint: the seam between minizero and the
    answer."""
    # nothing would be saved: nothing to checkpoint
    if not torch.is_grad_enabled():
        return forward(x)
    returned = False

    def run(*inputs):
        if returned and not torch.is_grad_enabled():
            raise AssertionError(
                f"rank {comm.rank()}, {name}: the recompute in backward ran with grad disabled, so "
                "it built no graph to backpropagate through: autograd runs a Function's backward "
                "under no_grad; recompute inside `with torch.enable_grad():`")
        # the recompute's activations count, as minizero's do
        with meter.recording():
            return forward(*inputs)

    output = answer.checkpoint(run, x)
    returned = True
    return output


def worker(module_name: str) -> dict:
    answer = g.learner(module_name)
    engines = []

    def build(model, optimizer, **options):
        engine = Zero2(model, optimizer, **options)
        for i, block in enumerate(model.blocks):
            block.forward = partial(
                checkpointed, answer, engine.activations, f"blocks.{i}", block.forward
            )
        engines.append(engine)
        return engine

    result = g.train_with(build, CFG)                  # yours first: a failing answer fails fast
    plain = dataclasses.replace(CFG, return_state=False)
    peaks = {"yours": engines[-1].memory()["activations"],   # the peak of the last step
             "none": train_worker(plain)["memory"]["activations"],
             "minizero": train_worker(dataclasses.replace(plain, activation_checkpointing=True))
             ["memory"]["activations"]}
    return {**result, "activations": peaks}


def launched(impl: str) -> list[dict]:
    """The ranks' results for impl; one launch serves every test of this grader
    (_grading.launch_once)."""
    return g.launch_once(worker, CFG.world_size, impl)


def check_training(impl: str) -> None:
    g.guard(impl, REFUSED)
    g.assert_matches_reference(CFG, launched(impl),
                               hint="Does backward backpropagate the incoming gradients through "
                                    "the recomputed output, and return each input's gradient?")


def check_memory(impl: str) -> None:
    __tracebackhide__ = True
    g.guard(impl, REFUSED)
    for res in launched(impl):
        peaks = res["activations"]
        if peaks["yours"] > MAX_FRACTION * peaks["none"]:
            raise AssertionError(
                f"rank {res['rank']}: with your checkpoint the peak of the activations saved for "
                f"backward is {peaks['yours']} bytes, {peaks['yours'] / peaks['none']:.0%} of the "
                f"{peaks['none']} bytes saved without checkpointing (minizero's checkpointing: "
                f"{peaks['minizero']} bytes); at most {MAX_FRACTION:.0%} expected. Does forward "
                "run the unit with grad disabled and save only its inputs, leaving the graph to "
                "the recompute in backward?")


@pytest.mark.points(2)
def test_checkpointed_blocks_train_like_one_process(impl):
    check_training(impl)


@pytest.mark.points(1)
def test_checkpointing_halves_the_saved_activations(impl):
    check_memory(impl)
