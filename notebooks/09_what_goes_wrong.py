# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 09 · What goes wrong at stage 3, and how to see it
#
# Three things surprise nearly everyone who moves a model to ZeRO stage 3: a run that hangs
# because one rank took another path, parameters that look broken outside forward, and generation
# that is slow because it gathers the model again for every token. Each has one cause, stage 3's
# contract: **a unit's parameters exist in full only while that unit runs, and every rank must
# gather every unit, in the same order.**
#
# The ranks run `minizero.lab.train.train_worker` (the training loop of notebooks 01-05) with a
# fault from `minizero.lab.faults` injected on one rank: a launched process imports the function
# it runs, so these live in the package, not in a cell. Every cell runs in seconds (N = 2 ranks,
# the tiny model).

# %% tags=["parameters"]
MODEL = "tiny"         # the GPT every run trains
N_LAYER = 4            # its transformer blocks: stage 3 gathers each one as a unit
WORLD_SIZE = 2         # N, the ranks
STEPS = 4              # training steps per run
FAULT_RANK = 1         # the rank that goes out of step
FAULT_STEP = 1         # in which step (0 is the first)
SKIPPED_BLOCK = 2      # "skip-block": the block that rank's forward leaves out

# %% [markdown]
# ## 1. The hang: one rank takes another path
#
# A backend matches collectives by their position, not by what they are for: rank 0's 41st
# collective meets rank 1's 41st, whatever each one meant. At stage 3 every unit's forward starts
# with an all-gather. If rank 1 skips block 2 in one step (an `if` on its data, an MoE expert no
# token reached, one micro-batch more), rank 1's all-gather of block 3 meets rank 0's all-gather of
# block 2. They have the same size, so they *exchange the wrong weights without an error*, and the
# first pair that differs in size or kind hangs.
#
# Without help that hang ends after the backend's collective timeout, 120 s here, with
# `rank 0 failed: RuntimeError: Application timeout caused pair closure`, which names nobody.
# minizero fingerprints every collective (kind, group, element count, dtype, what it is for) and
# compares the ranks' fingerprints (`minizero/beyond/desync.py`), so the same mistake ends in
# seconds with one line:

# %%
import dataclasses
import time

import minizero
from minizero.lab.faults import Fault
from minizero.lab.train import TrainConfig, train_worker

cfg = TrainConfig(stage=3, world_size=WORLD_SIZE, steps=STEPS, model=MODEL,
                  model_overrides={"n_layer": N_LAYER}, batch_size=12,
                  fault=Fault(rank=FAULT_RANK, step=FAULT_STEP, mode="skip-block",
                              block=SKIPPED_BLOCK))
start = time.monotonic()
try:
    minizero.launch(train_worker, WORLD_SIZE, cfg)
    verdict, flight_recorder = "no error: the ranks stayed in step", []
except RuntimeError as e:
    verdict, *flight_recorder = str(e).splitlines()
seconds = time.monotonic() - start
print(f"after {seconds:.1f} s:\n{verdict}\n")
print("\n".join(flight_recorder))

# %% [markdown]
# ## Reading the verdict
#
# - **The first line** names the rank that is out of step, the collective it issued, its position
#   in the sequence (`collective #…`), and what rank 0 issued there. With three or more ranks the
#   odd one out is named (the majority is taken as right); with two, rank 0 is the reference.
# - **The flight recorder** below it: each rank's last 20 collectives, when each was issued and
#   finished (`waiting` for one that never finished). Read down one rank's list and the other's
#   side by side: the first line where they differ is where the paths parted.
# - When a rank never issues the collective the others wait on (it is computing, or blocked outside
#   `minizero.comm`), the watchdog names it after `stall_timeout` seconds (default 20;
#   `launch(..., stall_timeout=...)`, `python -m minizero.run --stall-timeout S`,
#   `$MINIZERO_STALL_TIMEOUT_S`).
#
# **The fix:** every rank runs every unit, every step, and the same number of micro-batches per
# step. A branch that skips a block must take the same decision on every rank (decide it from the
# step number or a seed, not from the rank's data), or run the block and discard its output
# (`x = x + 0 * block(x)` keeps the gather and the gradient's reduce-scatter in step). The same
# holds for MoE experts: at stage 3 each expert is gathered only if it runs, so run every expert
# (possibly on an empty batch) on every rank.
#
# At stage 2 the same skipped block is no hang: gradients are reduced per bucket whatever the
# forward used, and the unused block's gradient is averaged with zeros (DDP's
# `find_unused_parameters`). An extra micro-batch does desynchronize stage 2 (one more
# reduce-scatter on one rank):

# %%
verdicts = {}
for stage in (2, 3):
    run = dataclasses.replace(cfg, stage=stage,
                              fault=Fault(rank=FAULT_RANK, step=FAULT_STEP,
                                          mode="extra-micro-batch"))
    try:
        minizero.launch(train_worker, WORLD_SIZE, run)
        verdicts[stage] = "no error: the ranks stayed in step"
    except RuntimeError as e:
        verdicts[stage] = str(e).splitlines()[0]
    print(f"stage {stage}: {verdicts[stage]}\n")

# %% [markdown]
# ### Every fault, at stage 2 or 3
#
# `minizero.lab.faults` injects four more ways for a rank to go wrong: it raises, or dies without a
# word (SIGKILL, what the kernel's OOM killer sends), or it leaves a block out, or runs one
# micro-batch more. Choose one and a stage: each ends in one line naming rank 1 (or trains to the
# end, where that stage is immune), never in a hang.

# %%
from ipywidgets import interact


def reproduce(mode, stage):
    """Train with `mode` injected on FAULT_RANK in step FAULT_STEP; print the first line it ends
    with, and after how long."""
    run = dataclasses.replace(cfg, stage=stage, fault=Fault(rank=FAULT_RANK, step=FAULT_STEP,
                                                            mode=mode, block=SKIPPED_BLOCK))
    start = time.monotonic()
    try:
        minizero.launch(train_worker, WORLD_SIZE, run)
        print(f"stage {stage}, {mode}: trained all {run.steps} steps, no error")
    except RuntimeError as e:
        print(f"stage {stage}, {mode}, after {time.monotonic() - start:.1f} s:\n"
              f"{str(e).splitlines()[0]}")


interact(reproduce, mode=["raise", "kill", "skip-block", "extra-micro-batch"], stage=[3, 2]);

# %% [markdown]
# ## 2. Parameters outside forward at stage 3
#
# Outside a unit's forward (and its backward) its parameters' values are not on this rank: the
# unit's buffer was released after use, which is the whole saving of stage 3. DeepSpeed makes this
# visible by replacing each parameter's data with an empty tensor, so `p.shape` prints
# `torch.Size([0])`; minizero keeps the shape (so `p.numel()` still counts Ψ) and points the
# parameter at a placeholder that reads as NaN and refuses writes (`[Note: absent parameters]` in
# minizero/absent.py). Either way **the values are not there**. To look at, print, compare or edit
# parameters between steps, gather them first:

# %%
import functools

import torch

from minizero.lab.model import GPTConfig, make_model

model = make_model(GPTConfig.named(MODEL, n_layer=N_LAYER))
engine = minizero.wrap(model, 3, functools.partial(torch.optim.SGD, lr=0.1))   # here: N = 1
w = model.blocks[0].ln1.weight
held = sum(unit.full_bytes() for unit in engine.units)              # every unit released
outside = bool(w.isnan().all())
print("outside forward:", w.shape, w[:4], f"({held} bytes gathered)")      # the shape kept, NaN
with engine.gathered([model.blocks[0]]):                             # every rank: a collective
    inside = w.untyped_storage().nbytes()
    print("inside gathered():", w.shape, inside, "bytes", w[:4])

# %% [markdown]
# `engine.gathered(modules)` is DeepSpeed's `GatheredParameters` and FSDP's `summon_full_params`:
# it gathers the units those modules belong to on every rank (so every rank must enter it, like any
# collective) and frees them when the block ends. Inside, the parameter is a view of its unit's
# whole gathered buffer (hence more bytes of storage than its own). With `modifier_rank=r`, what
# rank r writes inside the block reaches every rank and the optimizer's fp32 master weights.
# `engine.full_state_dict()` does the same for saving.
#
# ## 3. Why generation at stage 3 gathers unit by unit
#
# `generate()` runs one forward per new token, and each forward at stage 3 gathers each unit when
# its forward starts and frees it when it ends: T tokens through U units are T·U all-gathers of the
# units' parameters. Each one is a collective, so
#
# - **every rank must run generate, with the same number of steps**: if rank 0 generates alone, or
#   stops at an end-of-sequence token earlier than rank 1, the ranks fall out of step exactly as in
#   section 1 (and the verdict names it). Generate the same `max_new_tokens` on every rank, without
#   early stopping, or stop all ranks together (decide on rank 0, broadcast the decision).
# - it is slow for a reason: stage 3 trades memory for communication, and generation has little
#   compute to hide each gather behind. When the full model fits, gather it once for the whole
#   generation (DeepSpeed: `GatheredParameters` around `generate`); when it does not, this
#   unit-by-unit gathering is what makes the generation possible at all (ZeRO-Inference).

# %%
from minizero.lab.record import recorded

TOKENS = 3
x = torch.zeros(1, 4, dtype=torch.long)
with torch.no_grad(), recorded("collective") as log:
    for token in range(TOKENS):                     # one "generation" forward per new token
        engine(x)
gathers = [fields for _, _, fields in log if fields["kind"] == "all_gather" and fields["numel"]]
print(f"{len(gathers)} all-gathers for {TOKENS} forwards of {len(engine.units)} units; "
      "the first forward's, in the order it gathers them:")
print([fields["tag"] for fields in gathers[:len(engine.units)]])

# %% [markdown]
# The tags count the units in the order forward runs them: unit 0 is the root (embeddings, final
# LayerNorm, head), whose forward starts first, then one unit per block; the from-scratch stage 3
# of the capstone exercise numbers them the same way (`units[0]` is the root). Their gradient
# buckets lie the other way round, in the order backward completes them (zero3.py).

# %% [markdown]
# **What to try**
#
# - In the widget, `skip-block` at stage 2, then at stage 3: the same mistake is harmless at one
#   stage and a hang at the other.
# - `WORLD_SIZE = 3`: the verdict now names the odd rank out by majority, not against rank 0.
# - A rank that never issues the collective: write a worker that sleeps on rank 1 before its
#   forward (in a file of its own next to the notebook, as notebooks/ranks.py is for 01-05) and
#   launch it with `stall_timeout=5`: the watchdog names the rank that never arrived.
# - The same verdict from the command line: `MINIZERO_FAIL_RANK=1 MINIZERO_FAIL_STEP=1
#   MINIZERO_FAIL_MODE=skip-block MINIZERO_FAIL_BLOCK=1 python -m minizero.run --stage 3
#   --world-size 2 --model tiny` (the tiny model has blocks 0 and 1).
# - Count the all-gathers of section 3 with `TOKENS = 10`, then with more blocks (`N_LAYER = 8` in
#   the first cell): T·U, both ways.
