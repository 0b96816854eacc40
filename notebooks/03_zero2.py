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
# # 03 · ZeRO stage 2 (P_os+g): shard the gradients too
#
# A rank only ever uses the gradient of its own partition, so it need not keep the rest
# (`minizero/zero2.py`): as soon as a bucket of gradients is complete during backward it is
# reduce-scattered, rank r keeps its partition in a gradient shard of Ψ/N elements, and the full
# gradients are freed.
#
# $$M_{P_{os+g}} = b_p\,\Psi + \frac{(b_g + K)\,\Psi}{N} \qquad
# (2\Psi + 14\Psi/N\text{ in the paper})$$
#
# Communication is unchanged: reduce-scatter Ψ + all-gather Ψ = 2Ψ per step in a ring (3Ψ on gloo's
# wire, as in notebook 02), now overlapped with backward. (The measured *peak* during backward adds
# the buckets in flight; the plot shows what persists.)

# %% [markdown]
# **Exercise 06**:
# [`exercises/ex06_zero2_reduce_scatter.py`](../exercises/ex06_zero2_reduce_scatter.py), graded with
# `pytest exercises -k ex06`: reduce-scatter a gradient bucket into a shard from inside backward.

# %% tags=["parameters"]
from minizero.lab import demo
import plots                                  # notebooks/plots.py: the figures

MODEL, STEPS = "default", 10     # the small GPT, ~0.2 M parameters; "tiny": a few thousand
DTYPE = "fp32"     # or "bf16": the paper's 2 + 2 + 12 bytes per parameter (looser reference check)
BACKEND, WORLD_SIZES = demo.backend_and_world_sizes()   # gloo on CPU; NCCL with 2 or more GPUs

# %% [markdown]
# ## One step, rank by rank
#
# The same tiny model, recorder and grid as in notebook 01 (its "One step, rank by rank" explains
# how to read it), now at stage 2, with two buckets (8 and 9 elements).
#
# What to look for: gradients now live in two places. *Gradients in flight* is a bucket's full
# gradients, from the moment they are complete until its reduce-scatter arrives; the *gradient
# shard* (Ψ/N) is the only gradient memory that persists. Bucket 0 (the last layer, whose gradients
# backward produces first) is reduce-scattered into the shard while bucket 1 is still being
# computed; after backward the in-flight row is empty and each rank holds only the averaged
# gradients of its own partitions.

# %%
from minizero.lab import stepthrough

steps = stepthrough.record(stepthrough.StepConfig(stage=2))      # one launch
stepthrough.check(steps)       # every phase against one process stepping all 12 rows
print(plots.step_table(steps))           # every phase: each buffer that changed, on every rank

# %% [markdown]
# Play or drag through the phases; below each, the function of minizero that produced it, its line
# marked.

# %%
plots.step_widget(steps, stage=[0, 1, 2, 3], world_size=[2, 3, 4])

# %% [markdown]
# ### The lines that did it
#
# Stage 2 moves the reduce-scatter into backward (`minizero/zero2.py`, `GradientShard`): as each
# parameter's gradient is complete, `stage` copies it into its bucket's staging buffer and frees
# `p.grad` on the next line (*gradients in flight* above); when the bucket is complete, `reduce`
# starts its reduce-scatter (the reduce-scatter phases); when that arrives, `arrived` adds rank r's
# partition into the gradient shard and drops the staging buffer. The step and the all-gather
# after it are stage 1's. Marked: the lines that ran in the recording above and led to its phases
# or to an event (`stepthrough.ran`, from the events' call stacks: the first gradient of a bucket
# allocates its staging buffer); `arrived` is shown unmarked, as no event's stack passes through
# it.

# %%
from minizero.lab import source
from minizero.zero2 import GradientShard

source.show(*stepthrough.ran(steps, "GradientShard.stage", "GradientShard.reduce"),
            GradientShard.arrived)

# %% [markdown]
# ## The code every rank runs
#
# The worker of notebook 01, [`ranks.py`](ranks.py), at stage 2; `bucket_size` decides how many
# full gradients are in flight at once.

# %%
import importlib

import minizero

import ranks

importlib.reload(ranks)               # your edits to ranks.py, in this kernel too
N, OPTIONS = 2, {"bucket_size": 25e6}   # ranks; bytes per gradient bucket
for r in minizero.launch(ranks.train, N, 2, MODEL, OPTIONS, backend=BACKEND):
    on_wire = "n/a" if r["on_wire"] is None else f"{r['on_wire']:,}"
    m = r["memory"]
    print(f"rank {r['rank']}: loss {r['losses'][-1]:.4f}, params {m['params']:,} B, "
          f"grads {m['grads']:,} B, optimizer {m['optimizer']:,} B, peak {m['peak']:,} B, "
          f"last step sent {r['sent']:,.0f} B (ring model), {on_wire} B (on the wire)")

# %% [markdown]
# The peak is what persists (parameters, gradient shard, optimizer) plus the full gradients in
# flight: a 25 MB bucket holds this whole model, so once in backward its whole gradient exists
# before the reduce-scatter cuts it to the shard (peak = params + grads + optimizer + 4Ψ here).
# Change `N`: the gradient bytes per rank are 4Ψ/N. Set `OPTIONS = {"bucket_size": 2e4}`: the
# persistent bytes do not move, the peak falls (fewer full gradients in flight at once).
#
# ### A bucket's gradient shard, in this process
#
# What a reduce-scatter leaves rank r, computed here without any process group: N "ranks" each take
# their rows of a batch and run backward into their own flat gradient buffer
# (`minizero.flat.FlatLayout`, the buffers the engine reduces); the reduce-scatter averages each
# bucket over the ranks and hands rank r only its partition, which is copied into its gradient shard
# (`layout.shard`: Ψ/N elements, all the gradient memory stage 2 keeps). Change `N` or
# `BUCKET_BYTES` and run it again.

# %%
import torch
from torch import nn

from minizero.flat import FlatLayout, split_into_buckets

N, BUCKET_BYTES = 3, 40             # 40 B: buckets of ~10 fp32 elements, to see more than one
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 2))           # Ψ = 17
x = torch.randn(4 * N, 2)                                                     # 4 rows per rank
groups = split_into_buckets(list(model.parameters())[::-1], BUCKET_BYTES)    # backward's order
layouts = [FlatLayout.build(groups, world_size=N, rank=r) for r in range(N)]
own = []                                           # each rank's full gradients after its backward
for r, layout in enumerate(layouts):
    grads = torch.zeros(layout.padded_numel)
    layout.point_grads_into(grads)                 # backward writes into the flat buffer
    model(x[4 * r: 4 * (r + 1)]).pow(2).mean().backward()
    own.append(grads)
    model.zero_grad(set_to_none=True)
mean = torch.stack(own).mean(0)            # what the reduce-scatter computes, bucket by bucket
for r, layout in enumerate(layouts):
    shard = torch.zeros(layout.shard_numel)        # rank r's gradient shard
    for b in layout.buckets:
        layout.shard(shard, b).copy_(layout.my_partition(layout.full(mean, b), b))
    print(f"rank {r}: gradient shard of {layout.shard_numel} of {layout.padded_numel} elements "
          f"{shard.numpy().round(3)}")
print(f"buckets: {[b.padded_numel for b in layouts[0].buckets]} elements, each a multiple of N")

# %% [markdown]
# ## Run it
#
# Every world size, measured against one process training on the whole batch, as in notebooks 01
# and 02: the same parameters, now with (b_g + K)Ψ/N gradient and optimizer bytes per rank.

# %%
runs = demo.measure_stage(2, WORLD_SIZES, DTYPE, steps=STEPS, model=MODEL, backend=BACKEND)
for n, rec in runs.items():
    print(f"N = {n}: max |param - reference| = {rec['max_abs_diff']:.2e} "
          f"(tolerance {rec['tolerance']:g}), "
          f"loss {rec['losses'][0]:.3f} -> {rec['losses'][-1]:.3f}")

# %% [markdown]
# ## Measured memory next to the formula
#
# As in notebook 01: rank 0's bytes by category after the last backward, the formula's ticks, the
# check. New here: the gradient bar falls with N too, and only the parameters stay whole.

# %%
table = demo.memory_table(runs)          # what the plot draws, as rows
for row in table:
    if row["formula"] or row["measured"]:
        print(f"N = {row['world_size']}  {row['category']:>9}: "
              f"measured {row['measured'] / 1e3:8.1f} kB, formula {row['formula'] / 1e3:8.1f} kB")
demo.check(runs)                         # reference, memory and comm against the formulas
print("all ranks match the reference and the formulas")

# %%
plots.memory_by_category(runs, "stage 2");

# %% [markdown]
# ## What to try
#
# In the step-through, switch between stage 1 and stage 2 at the same N and compare the gradient
# rows at the end of backward: a full buffer per rank against a shard. Try N = 3, then 4: each
# bucket is padded to a multiple of N on its own, so the padding moves from bucket 0 (8 elements ->
# 9 at N = 3) to bucket 1 (9 -> 12 at N = 4). Above, the gradient bar is 1/N of the DDP one (b_gΨ/N
# against b_gΨ). Then do exercise 6: reduce-scatter a bucket into the shard from the backward hook.
