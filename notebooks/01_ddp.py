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
# # 01 · DDP: the baseline ZeRO starts from
#
# Distributed data parallel (`minizero/ddp.py`): every rank keeps the **whole** model, its gradients
# and its optimizer state, and processes 1/N of the global batch. After backward the gradients are
# averaged with an all-reduce, in buckets that start while backward is still running, so every replica
# takes the same step.
#
# Per rank, with Ψ parameters, $b_p$ / $b_g$ bytes per parameter and gradient and K bytes of optimizer
# state per parameter (the paper: bf16 and Adam, $2 + 2 + 12$):
#
# $$M_{DDP} = (b_p + b_g + K)\,\Psi = 16\Psi \quad\text{for every } N$$
#
# Communication per step: one all-reduce of the gradients, $2\Psi\frac{N-1}{N}$ elements.
# (Here in fp32: $b_p = b_g = 4$, and Adam's K = 8 with no separate master copy; also 16Ψ.)

# %% [markdown]
# **Exercise.** [../exercises/ex02_ddp_bucket.py](../exercises/ex02_ddp_bucket.py): gradient buckets that all-reduce during backward.

# %%
import os
from minizero.lab import demo
import plots                                  # notebooks/plots.py: the figures

SMALL = os.environ.get("MINIZERO_SMALL") == "1"     # CI: the tiny model, 2 steps
MODEL, STEPS = ("tiny", 2) if SMALL else ("default", 10)
DTYPE = "fp32"        # or "bf16": the paper's 2 + 2 + 12 bytes per parameter (looser reference check)
BACKEND, WORLD_SIZES = demo.backend_and_world_sizes()   # gloo on CPU; NCCL with 2 or more GPUs
if SMALL:
    WORLD_SIZES = (WORLD_SIZES[0], WORLD_SIZES[-1])     # one launch fewer
print(f"backend {BACKEND}, world sizes {WORLD_SIZES}, model {MODEL!r}, {STEPS} steps, {DTYPE}")

# %% [markdown]
# ## One step, rank by rank
#
# A model small enough to read every number: `Linear(2, 3)`, tanh, `Linear(3, 2)`, Ψ = 17 parameters (none
# of N = 2, 3, 4 divides 17, so the flat buffer is padded), SGD with momentum 0.9 and lr 0.1 (the first
# step is $p - 0.1\,g$), 12 rows split over the ranks. `minizero.lab.stepthrough.record` wraps it with
# `minizero.wrap`, trains one step on N processes and records what every rank holds after each phase, read
# from the engine's own buffers. Each buffer is a grid: a row per rank, a column per element of the padded
# flat buffer (the parameter each element belongs to is named on top). Dashed lines: partition boundaries
# (partition r is rank r's); solid: bucket boundaries; grey: padding; blank: the rank does not hold that
# element; bold and framed: changed in this phase. (The recorder lets one bucket communicate at a time, so
# each collective is its own phase; minizero overlaps two.)
#
# What to look for: when a bucket's gradients are complete every rank holds its *own* gradients (its own
# rows); the bucket's all-reduce replaces them with the average, on every rank, while backward goes on with
# the next bucket. The step then does the same update on every rank, and every rank keeps the whole
# momentum (the optimizer state, K bytes per parameter): N identical copies of everything, the
# redundancy ZeRO removes. Pick stage 1, 2 or 3 in the menu to see what each removes.

# %%
from minizero.lab import stepthrough

steps = stepthrough.record(stepthrough.StepConfig(stage=0))      # one launch
stepthrough.check(steps)       # every phase against one process stepping all 12 rows
print(plots.step_table(steps))           # every phase: each buffer that changed, on every rank
demo.export("steps_0", {"steps": steps});   # tests/test_notebooks.py checks it again

# %% [markdown]
# Press play or drag the slider through the phases. A menu records the step again with another setting
# (one launch, about a second; each setting is kept once computed).

# %%
plots.step_widget(steps, stage=[0, 1, 2, 3], world_size=[2, 3, 4])

# %% [markdown]
# ## Run it
#
# One `minizero.launch` per world size runs `minizero.lab.train.train_worker` on every rank (the worker
# lives in `minizero/lab/demo.py`, because launched processes cannot import a notebook cell). Every run
# is compared with `minizero.lab.reference.reference_train`: one process, the whole global batch, plain
# `torch.optim`. Data parallelism must not change the result, only where the bytes live.

# %%
runs = demo.measure_stage(0, WORLD_SIZES, DTYPE, steps=STEPS, model=MODEL, backend=BACKEND)
for n, rec in runs.items():
    print(f"N = {n}: max |param - reference| = {rec['max_abs_diff']:.2e} (tolerance {rec['tolerance']:g}), "
          f"loss {rec['losses'][0]:.3f} -> {rec['losses'][-1]:.3f}")

# %% [markdown]
# ## Measured memory next to the formula
#
# `engine.memory()` counts the bytes of every tensor rank 0 holds, by category, at the end of the last
# backward (optimizer state exists, gradients are complete). The black ticks are
# `minizero.run.theory`, i.e. `minizero.memory.estimate_breakdown` with this run's bytes per element
# and K. The check below is the same comparison the plot shows: measured = formula, up to the padding
# of each bucket to a multiple of N elements.

# %%
table = demo.memory_table(runs)          # what the plot draws, as rows
for row in table:
    if row["formula"] or row["measured"]:
        print(f"N = {row['world_size']}  {row['category']:>9}: measured {row['measured'] / 1e3:8.1f} kB, "
              f"formula {row['formula'] / 1e3:8.1f} kB")
demo.check(runs)                         # reference, memory and comm against the formulas
print("all ranks match the reference and the formulas")

# %%
plots.memory_by_category(runs, "DDP");

# %%
demo.export("stage_0", {"runs": list(runs.values())});   # for tests/test_notebooks.py

# %% [markdown]
# ## Same training as one process
#
# The mean loss over ranks at each step, for every N, on top of the single-process reference:

# %%
plots.loss_curves(runs, "DDP: losses at every N equal the reference");

# %% [markdown]
# Nothing in the memory plot shrinks with N: that redundancy, N copies of 16Ψ bytes, is what ZeRO
# removes, one category at a time, in the next three notebooks.

# %% [markdown]
# ## What to try
#
# In the step-through, switch N between 2, 3 and 4: the averaged gradient is the same every time (it is the
# gradient of the same 12 rows), only each rank's own gradients change. Switch to stage 1 and compare the
# momentum row. Above, set `DTYPE = "bf16"` in the setup cell and run all: the parameter and gradient bars
# halve, the optimizer bar grows (fp32 master weights join Adam's moments), and the reference check loosens
# to bf16's tolerance. Then do exercise 2: build the bucket hook yourself.
