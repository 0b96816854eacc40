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
# $$M_{P_{os+g}} = b_p\,\Psi + \frac{(b_g + K)\,\Psi}{N} \qquad
# (2\Psi + 14\Psi/N\text{ in the paper})$$
#
# Communication is unchanged: reduce-scatter Ψ + all-gather Ψ = 2Ψ per step, now overlapped with
# backward. (The measured *peak* during backward adds the buckets in flight; the plot shows what
# persists.)

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
# Press play or drag the slider through the phases. A menu records the step again with another
# setting (one launch, about a second; each setting is kept once computed).

# %%
plots.step_widget(steps, stage=[0, 1, 2, 3], world_size=[2, 3, 4])

# %% [markdown]
# ## The code every rank runs
#
# `minizero.launch(fn, N, *args)` starts N processes, joins them into one process group and calls
# `fn(*args)` on each; a process can import a file but not a notebook cell, so the next cell
# *writes* the worker to `zero2_ranks.py` next to this notebook. Edit it and run both cells again:
# the ranks import the new file. `minizero.wrap(model, 2, ...)` is stage 2: `engine.backward(loss)`
# reduce-scatters each bucket of gradients as soon as backward completes it and keeps only this
# rank's partition (the gradient shard); `engine.step()` steps it and all-gathers the parameters.

# %%
# %%writefile zero2_ranks.py
"""What every rank of notebooks/03_zero2.ipynb runs (that notebook writes this file)."""
import functools

import torch

import minizero
from minizero import comm
from minizero.lab.data import global_batch, local_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import loss_fn


def train(model, bucket_size, steps=3, batch_size=24):
    cfg = GPTConfig.named(model)
    net = make_model(cfg, seed=0)                 # the same initial weights on every rank
    engine = minizero.wrap(net, 2, functools.partial(torch.optim.AdamW, lr=1e-3),
                           bucket_size=bucket_size)
    for step in range(steps):
        comm.reset_tally()                        # count this step's bytes only
        x, y = global_batch(step, batch_size, cfg.block_size)        # one global batch ...
        x, y = local_batch(x, y, comm.rank(), comm.world_size())     # ... this rank's rows of it
        loss = loss_fn(engine(x), y)
        engine.backward(loss)       # each full bucket reduce-scattered into my gradient shard
        engine.step()               # step my partition, all-gather the parameters
    return {"rank": comm.rank(), "loss": loss.item(), "memory": engine.memory(),
            "sent": comm.tally()["total"]}

# %%
import importlib

import minizero

import zero2_ranks

importlib.reload(zero2_ranks)          # this kernel reads the file again too
N, BUCKET_SIZE = 2, 25e6             # ranks; bytes per gradient bucket
for r in minizero.launch(zero2_ranks.train, N, MODEL, BUCKET_SIZE, backend=BACKEND):
    m = r["memory"]
    print(f"rank {r['rank']}: loss {r['loss']:.4f}, params {m['params']:,} B, "
          f"grads {m['grads']:,} B, optimizer {m['optimizer']:,} B, peak {m['peak']:,} B, "
          f"sent {r['sent']:,.0f} B in the last step")

# %% [markdown]
# Change `N`: the gradient bytes per rank are Ψ/N. Change `BUCKET_SIZE` to `2e4`: the persistent
# bytes do not move, the peak does (fewer full gradients in flight at once).
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
# Now at every world size, measured: one `minizero.launch` per N runs
# `minizero.lab.train.train_worker` on every rank, the loop of the worker above plus what `python -m
# minizero.run` measures (memory by category, bytes sent, step times). Every run is compared with
# `minizero.lab.reference.reference_train`: one process, the whole global batch, plain
# `torch.optim`. Data parallelism must not change the result, only where the bytes live.

# %%
runs = demo.measure_stage(2, WORLD_SIZES, DTYPE, steps=STEPS, model=MODEL, backend=BACKEND)
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
plots.memory_by_category(runs, "stage 2");

# %% [markdown]
# ## What to try
#
# In the step-through, switch between stage 1 and stage 2 at the same N and compare the gradient
# rows at the end of backward: a full buffer per rank against a shard. Try N = 4: each bucket is
# padded to a multiple of 4 on its own, so padding appears in both buckets. Above, the gradient bar
# should be Ψ/N of the DDP one. Then do exercise 6: reduce-scatter a bucket into the shard from the
# backward hook.
