# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
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
# averaged with an all-reduce, in buckets that start while backward is still running, so every
# replica takes the same step.
#
# Per rank, with Ψ parameters, $b_p$ / $b_g$ bytes per parameter and gradient and K bytes of
# optimizer state per parameter (the paper: bf16 and Adam, $2 + 2 + 12$):
#
# $$M_{DDP} = (b_p + b_g + K)\,\Psi = 16\Psi \quad\text{for every } N$$
#
# Communication per step: one all-reduce of the gradients, $2\Psi\frac{N-1}{N}$ elements.
# (Here in fp32: $b_p = b_g = 4$, and Adam's K = 8 with no separate master copy; also 16Ψ.)

# %% [markdown]
# **Exercise 02**: [`exercises/ex02_ddp_bucket.py`](../exercises/ex02_ddp_bucket.py), graded with
# `pytest exercises -k ex02`: gradient buckets, and the hook that starts averaging one inside
# backward.
#
# **Exercise 03**: [`exercises/ex03_grad_accumulation.py`](../exercises/ex03_grad_accumulation.py),
# graded with `pytest exercises -k ex03`: gradient accumulation (`no_sync`): K micro-batches, one
# all-reduce a step.

# %% tags=["parameters"]
from minizero.lab import demo
import plots                                  # notebooks/plots.py: the figures

MODEL, STEPS = "default", 10     # the small GPT, ~0.2 M parameters; "tiny": a few thousand
DTYPE = "fp32"     # or "bf16": the paper's 2 + 2 + 12 bytes per parameter (looser reference check)
BACKEND, WORLD_SIZES = demo.backend_and_world_sizes()   # gloo on CPU; NCCL with 2 or more GPUs

# %% [markdown]
# ## One step, rank by rank
#
# A model small enough to read every number: `Linear(2, 3)`, tanh, `Linear(3, 2)`, Ψ = 17 parameters
# (none of N = 2, 3, 4 divides 17, so the flat buffer is padded), SGD with momentum 0.9 and lr 0.1
# (the first step is $p - 0.1\,g$), 12 rows split over the ranks. `minizero.lab.stepthrough.record`
# wraps it with `minizero.wrap`, trains one step on N processes and records what every rank holds
# after each phase, read from the engine's own buffers. Each buffer is a grid: a row per rank, a
# column per element of the padded flat buffer (the parameter each element belongs to is named on
# top). Dashed lines: partition boundaries (partition r is rank r's); solid: bucket boundaries;
# grey: padding; blank: the rank does not hold that element; bold and framed: changed in this phase.
# (The recorder lets one bucket communicate at a time, so each collective is its own phase; minizero
# overlaps two.)
#
# What to look for: when a bucket's gradients are complete every rank holds its *own* gradients (its
# own rows); the bucket's all-reduce replaces them with the average, on every rank, while backward
# goes on with the next bucket. The step then does the same update on every rank, and every rank
# keeps the whole momentum (the optimizer state, K bytes per parameter): N identical copies of
# everything, the redundancy ZeRO removes. Pick stage 1, 2 or 3 in the menu to see what each
# removes.

# %%
from minizero.lab import stepthrough

steps = stepthrough.record(stepthrough.StepConfig(stage=0))      # one launch
stepthrough.check(steps)       # every phase against one process stepping all 12 rows
print(plots.step_table(steps))           # every phase: each buffer that changed, on every rank

# %% [markdown]
# Press play or drag the slider through the phases. A menu records the step again with another
# setting (one launch, about a second; each setting is kept once computed). Below each phase: the
# function of minizero that produced it, read from its file, the line that ran marked (the table
# above names it after each phase's `<-`).

# %%
plots.step_widget(steps, stage=[0, 1, 2, 3], world_size=[2, 3, 4])

# %% [markdown]
# ### The lines that did it
#
# DDP's whole algorithm is one call in `minizero/ddp.py`: when the reducer (`minizero/reducer.py`)
# sees that backward has completed every gradient of a bucket, it calls the gradients' `reduce`
# (`AllReducedGradients`, DDP's row of the table in `minizero/stages.py`), which starts the
# all-reduce of the bucket's flat gradients with `op="avg"` and returns at once
# (`async_op=True`): the all-reduce phases above. The step (`Engine.step` in
# `minizero/engine.py`) then runs the same optimizer on the same averaged gradients on every rank.
# Below, those functions read from the files now; marked are the lines that ran in the recording
# above and led to its phases (`stepthrough.ran` finds them on the call stacks of the events the
# recorder saw, so they stay right when the code moves). Unmarked lines did not run here, or ran
# without leading to a phase.

# %%
from minizero.lab import source

source.show(*stepthrough.ran(steps, "AllReducedGradients.reduce", "Engine.step"))

# %% [markdown]
# ## The code every rank runs
#
# `minizero.launch(fn, N, *args)` starts N processes, joins them into one process group and calls
# `fn(*args)` on each. A process can import a file but not a notebook cell, so what the ranks run
# is [`ranks.py`](ranks.py), next to this notebook and shared by notebooks 01-05: one training loop
# whose stage and `minizero.wrap` options are arguments. Open it and edit it: the next launch
# imports the file as it is then. `minizero.wrap(model, 0, ...)` is DDP; `engine.backward(loss)`
# all-reduces each bucket of gradients as soon as backward completes it; `engine.step()` takes the
# same step on every replica. Read from the file:

# %%
import ranks

source.show(ranks.train)

# %%
import importlib

import minizero

importlib.reload(ranks)              # your edits to ranks.py, in this kernel too
N, OPTIONS = 2, {"bucket_size": 25e6}    # ranks; bytes per gradient bucket (PyTorch DDP's 25 MB)
for r in minizero.launch(ranks.train, N, 0, MODEL, OPTIONS, backend=BACKEND):
    on_wire = "n/a" if r["on_wire"] is None else f"{r['on_wire']:,}"
    print(f"rank {r['rank']}: loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, "
          f"params {r['memory']['params']:,} B, optimizer {r['memory']['optimizer']:,} B, "
          f"last step sent {r['sent']:,.0f} B (ring model), {on_wire} B (on the wire)")

# %% [markdown]
# Every rank holds the same bytes whatever N: the whole model, its gradients and Adam's two moments.
# Only the rows differ, so each rank's own loss differs, and after the all-reduce the step does not.
# The last step's bytes are counted twice: the ring model's, 2(N-1)/N·4Ψ (`comm.tally()`), and what
# this rank put on the wire (`minizero.memory.wire`): the same, plus gloo's message headers
# (notebook 00 measures each collective).
# The optimizer's bytes are 2 × 4Ψ and 4 more: AdamW's step count, a one-element fp32 tensor for
# each tensor it steps (minizero hands it each bucket's master as views of about 1 MiB,
# `[Note: cache-sized views]` in `minizero/optim.py`; here one bucket, one view). Every notebook's
# optimizer figure carries those few bytes.
#
# ### A bucket, in this process
#
# DDP does not all-reduce gradient by gradient: `minizero.flat` lays the parameters end to end in
# buckets of about `bucket_size` bytes (last layer first, the order backward completes them), and
# each parameter's `.grad` becomes a view into its bucket's buffer, so backward writes straight into
# what the all-reduce sends (PyTorch DDP's `gradient_as_bucket_view`). Below, on one process,
# without any communication: a small model, its buckets, and one backward's gradients in the flat
# buffer. Change `BUCKET_BYTES` and run it again.

# %%
import torch
from torch import nn

from minizero.flat import FlatLayout, split_into_buckets

BUCKET_BYTES = 40                    # tiny on purpose: a bucket closes at >= 10 fp32 elements
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 2))           # Ψ = 17
params = list(model.parameters())[::-1]           # backward completes the last layer first
layout = FlatLayout.build(split_into_buckets(params, BUCKET_BYTES), world_size=1, rank=0, pad=False)
grads = torch.zeros(layout.padded_numel)          # the flat gradient buffer
layout.point_grads_into(grads)                    # every p.grad is now a view of `grads`
model(torch.randn(4, 2)).pow(2).mean().backward()
names = {id(p): name for name, p in model.named_parameters()}
for b in layout.buckets:
    print(f"bucket {b.index}: {[names[id(p)] for p in b.params]}, {b.numel} elements, "
          f"buffer[{b.start}:{b.start + b.numel}] = {layout.full(grads, b).numpy().round(3)}")
for b in layout.buckets:                          # .grad is the buffer, not a copy of it
    assert all(p.grad.data_ptr() == v.data_ptr() for p, v in b.views(layout.full(grads, b)))

# %% [markdown]
# ## Run it
#
# Now at every world size, measured: one `minizero.launch` per N runs
# `minizero.lab.train.train_worker` on every rank, the loop of the worker above plus what `python -m
# minizero.run` measures (memory by category, bytes sent, step times). Every run is compared with
# `minizero.lab.reference.reference_train`: one process, the whole global batch, plain
# `torch.optim`. Data parallelism must not change the result, only where the bytes live.

# %%
runs = demo.measure_stage(0, WORLD_SIZES, DTYPE, steps=STEPS, model=MODEL, backend=BACKEND)
for n, rec in runs.items():
    print(f"N = {n}: max |param - reference| = {rec['max_abs_diff']:.2e} "
          f"(tolerance {rec['tolerance']:g}), "
          f"loss {rec['losses'][0]:.3f} -> {rec['losses'][-1]:.3f}")

# %% [markdown]
# ## Measured memory next to the formula
#
# `engine.memory()` counts the bytes of every tensor rank 0 holds, by category, at the end of the
# last backward (optimizer state exists, gradients are complete). The black ticks are
# `minizero.lab.report.theory`, i.e. `minizero.memory.estimate_breakdown` with this run's bytes per
# element and K. The check below is the same comparison the plot shows: measured = formula, up to
# the padding of each bucket to a multiple of N elements.

# %%
table = demo.memory_table(runs)          # what the plot draws, as rows
for row in table:
    if row["formula"] or row["measured"]:
        print(f"N = {row['world_size']}  {row['category']:>9}: "
              f"measured {row['measured'] / 1e3:8.1f} kB, formula {row['formula'] / 1e3:8.1f} kB")
demo.check(runs)                         # reference, memory and comm against the formulas
print("all ranks match the reference and the formulas")

# %%
plots.memory_by_category(runs, "DDP");

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
# In the step-through, switch N between 2, 3 and 4: the averaged gradient is the same every time (it
# is the gradient of the same 12 rows), only each rank's own gradients change. Switch to stage 1 and
# compare the momentum row. Above, set `DTYPE = "bf16"` in the setup cell and run all: the parameter
# and gradient bars halve, the optimizer bar grows (fp32 master weights join Adam's moments), and
# the reference check loosens to bf16's tolerance. Then do exercise 2: build the bucket hook
# yourself.
