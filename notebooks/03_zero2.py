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
# # 03 · ZeRO stage 2 (P_os+g): shard the gradients too
#
# A rank only ever uses the gradient of its own partition, so it need not keep the rest
# (`minizero/zero2.py`): as soon as a bucket of gradients is complete during backward it is
# reduce-scattered, rank r keeps its partition in a gradient shard of Ψ/N elements, and the full
# gradients are freed.
#
# $$M_{P_{os+g}} = b_p\,\Psi + \frac{(b_g + K)\,\Psi}{N} \qquad (2\Psi + 14\Psi/N\text{ in the paper})$$
#
# Communication is unchanged: reduce-scatter Ψ + all-gather Ψ = 2Ψ per step, now overlapped with
# backward. (The measured *peak* during backward adds the buckets in flight; the plot shows what
# persists.)

# %% [markdown]
# **Exercise.** [../exercises/ex04_zero2_reduce_scatter.py](../exercises/ex04_zero2_reduce_scatter.py): reduce-scatter a gradient bucket into a shard during backward.

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
# What to look for: gradients now live in two places. *Gradients in flight* is a bucket's full gradients,
# from the moment they are complete until its reduce-scatter arrives; the *gradient shard* (Ψ/N) is the
# only gradient memory that persists. Bucket 0 (the last layer, whose gradients backward produces first) is
# reduce-scattered into the shard while bucket 1 is still being computed; after backward the in-flight row
# is empty and each rank holds only the averaged gradients of its own partitions.

# %%
from minizero.lab import stepthrough

steps = stepthrough.record(stepthrough.StepConfig(stage=2))      # one launch
stepthrough.check(steps)       # every phase against one process stepping all 12 rows
print(plots.step_table(steps))           # every phase: each buffer that changed, on every rank
demo.export("steps_2", {"steps": steps});   # tests/test_notebooks.py checks it again

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
runs = demo.measure_stage(2, WORLD_SIZES, DTYPE, steps=STEPS, model=MODEL, backend=BACKEND)
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
plots.memory_by_category(runs, "stage 2");

# %%
demo.export("stage_2", {"runs": list(runs.values())});   # for tests/test_notebooks.py

# %% [markdown]
# ## What to try
#
# In the step-through, switch between stage 1 and stage 2 at the same N and compare the gradient rows at the
# end of backward: a full buffer per rank against a shard. Try N = 4: each bucket is padded to a multiple of
# 4 on its own, so padding appears in both buckets. Above, the gradient bar should be Ψ/N of the DDP one.
# Then do exercise 4: reduce-scatter a bucket into the shard from the backward hook.
