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
# # 04 · ZeRO stage 3 (P_os+g+p): shard the parameters
#
# Stage 3 (`minizero/zero3.py`) also keeps only 1/N of the parameters. The model is cut into *units*
# (here: each transformer block, plus the root with the embeddings). A unit's full parameters exist
# only while it computes: a forward pre-hook all-gathers them, a post-hook frees them; in backward a
# hook on the unit's output gathers them again, and when the unit's gradients are complete they are
# reduce-scattered and the parameters freed.
#
# $$M_{P_{os+g+p}} = \frac{(b_p + b_g + K)\,\Psi}{N} \qquad (16\Psi/N\text{ in the paper})$$
#
# plus the few units gathered at a time. Communication: all-gather Ψ (forward) + all-gather Ψ
# (backward) + reduce-scatter Ψ = **3Ψ**, 1.5× DDP, the price of not replicating parameters.

# %% [markdown]
# **Exercise 07**: [`exercises/ex07_zero3_hooks.py`](../exercises/ex07_zero3_hooks.py), graded with
# `pytest exercises -k ex07`: the four hooks of a unit, with prefetch: gather (the next unit ahead),
# free, gather, reduce-scatter and free.
#
# **Exercise 08**:
# [`exercises/ex08_zero3_from_scratch.py`](../exercises/ex08_zero3_from_scratch.py), graded with
# `pytest exercises -k ex08`: the capstone: ZeRO-3 from plain PyTorch, a whole stage-3 wrapper and
# its sharded optimizer from torch and `minizero.comm`.

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
# What to look for: between uses a rank holds only its *parameter shard*; the parameters row is
# empty except while a unit (here each Linear) is gathered. Each unit is all-gathered for its
# forward and freed, gathered again for its backward, its gradients reduce-scattered into the
# gradient shard, and freed. The step updates the shard in place and nothing is gathered after it:
# the next forward gathers what it needs. (Prefetch is off here, so each gather is its own phase;
# with prefetch the next unit's all-gather would already be in flight.)

# %%
from minizero.lab import stepthrough

steps = stepthrough.record(stepthrough.StepConfig(stage=3))      # one launch
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
# *writes* the worker to `zero3_ranks.py` next to this notebook. Edit it and run both cells again:
# the ranks import the new file. `minizero.wrap(model, 3, ...)` is stage 3: `engine(x)` all-gathers
# each unit just before it runs and frees it after; `engine.backward(loss)` gathers each unit again
# for its backward and reduce-scatters its gradients; `engine.step()` steps this rank's shard only.

# %%
# %%writefile zero3_ranks.py
"""What every rank of notebooks/04_zero3.ipynb runs (that notebook writes this file)."""
import functools

import torch

import minizero
from minizero import comm
from minizero.lab.data import global_batch, local_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import loss_fn


def train(model, prefetch, steps=3, batch_size=24):
    cfg = GPTConfig.named(model)
    net = make_model(cfg, seed=0)                 # the same initial weights on every rank
    engine = minizero.wrap(net, 3, functools.partial(torch.optim.AdamW, lr=1e-3),
                           prefetch=prefetch)
    for step in range(steps):
        comm.reset_tally()                        # count this step's bytes only
        x, y = global_batch(step, batch_size, cfg.block_size)        # one global batch ...
        x, y = local_batch(x, y, comm.rank(), comm.world_size())     # ... this rank's rows of it
        loss = loss_fn(engine(x), y)
        engine.backward(loss)       # each unit gathered again, its gradients reduce-scattered
        engine.step()               # my shard only: nothing to gather after it
    return {"rank": comm.rank(), "loss": loss.item(), "memory": engine.memory(),
            "sent": comm.tally()["total"]}

# %%
import importlib

import minizero

import zero3_ranks

importlib.reload(zero3_ranks)          # this kernel reads the file again too
N, PREFETCH = 2, True                # ranks; gather the next unit while this one computes
for r in minizero.launch(zero3_ranks.train, N, MODEL, PREFETCH, backend=BACKEND):
    m = r["memory"]
    print(f"rank {r['rank']}: loss {r['loss']:.4f}, params {m['params']:,} B, "
          f"grads {m['grads']:,} B, optimizer {m['optimizer']:,} B, "
          f"parameters at most {m['peak_params']:,} B, sent {r['sent']:,.0f} B in the last step")

# %% [markdown]
# Change `N`: every category is 1/N. Set `PREFETCH = False`: the parameters' peak falls by about one
# unit.
#
# ### A unit's storage, in this process
#
# Stage 3 keeps a unit's full parameters only while it computes. Below, on one process (N = 1, no
# communication), a model wrapped at stage 3 with each `Linear` a unit, and two forward hooks of our
# own on the last unit: the bytes of its weight's storage before the forward, while the unit runs
# and after. The engine's own hooks, registered first, gather before ours and free before our
# post-hook sees it. Change `UNITS` to `[model[0], model[2]]` (the last Linear then belongs to the
# model's root unit, which stays gathered from the first forward to the end of backward) and run it
# again.

# %%
import functools

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
UNITS = [model[0], model[2], model[4]]
engine = minizero.wrap(model, 3, functools.partial(torch.optim.SGD, lr=0.1), units=UNITS)
weight, seen = model[4].weight, []


def record(when):          # a hook that notes how many bytes the weight's storage holds now
    return lambda *_: seen.append((when, weight.untyped_storage().nbytes()))


record("before forward")()
model[4].register_forward_pre_hook(record("unit running"))
model[4].register_forward_hook(record("unit done"))
loss = engine(torch.randn(4, 2)).pow(2).mean()
engine.backward(loss)
record("after backward")()
for when, nbytes in seen:
    print(f"{when:>15}: model[4].weight's storage holds {nbytes} bytes")

# %% [markdown]
# ## Run it
#
# Now at every world size, measured: one `minizero.launch` per N runs
# `minizero.lab.train.train_worker` on every rank, the loop of the worker above plus what `python -m
# minizero.run` measures (memory by category, bytes sent, step times). Every run is compared with
# `minizero.lab.reference.reference_train`: one process, the whole global batch, plain
# `torch.optim`. Data parallelism must not change the result, only where the bytes live.

# %%
runs = demo.measure_stage(3, WORLD_SIZES, DTYPE, steps=STEPS, model=MODEL, backend=BACKEND)
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
plots.memory_by_category(runs, "stage 3");

# %% [markdown]
# ## When is each unit gathered?
#
# A Zero3 engine emits an event each time a unit is gathered (or prefetched) and freed
# (`minizero/events.py`); `minizero.lab.demo.unit_timeline` collects them as `(time, "gather" |
# "prefetch" | "free", unit)` for one step after a warm-up step, which records the order prefetch
# follows (`minizero.lab.demo.zero3_timeline_worker`). Each bar is a span during which a unit's
# full parameters exist on rank 0. Without prefetch a unit is gathered when it is needed and the
# computation waits; with prefetch the next unit's all-gather is already in flight while the current
# one computes (hatched bars), at the cost of one more unit in memory.

# %%
timelines = demo.zero3_timelines(max(WORLD_SIZES), model=MODEL, backend=BACKEND)   # one launch
intervals = {p: demo.unit_intervals(rec) for p, rec in timelines.items()}
for p, ivs in intervals.items():
    names = timelines[p]["unit_names"]
    for b, name in enumerate(names):   # every unit: gathered once for forward, once for backward
        assert [iv["phase"] for iv in ivs if iv["unit"] == b] == ["forward", "backward"], name
    print(f"prefetch {'on ' if p else 'off'}: {len(ivs)} gather->free spans over "
          f"{len(names)} units, peak parameters {timelines[p]['peak_params'] / 1e3:.1f} kB")
plots.unit_timeline(timelines, intervals);

# %% [markdown]
# The root unit (embeddings, final LayerNorm, the head tied to the embedding) stays gathered for the
# whole forward and again for the whole backward: it runs first and last. The blocks take turns.

# %% [markdown]
# ## Fine-tuning: the frozen weights are sharded too
#
# In fine-tuning most parameters are frozen (Ψ_f: LoRA trains small adapters on a frozen base). They
# have no gradient and no optimizer state, but they are parameters: stage 3 partitions them with
# their unit (a second buffer, gathered and freed with it, never reduced), so per rank
#
# $$M_{params} = \frac{(\Psi + \Psi_f)\,b_p}{N}, \qquad M_{grads} = \frac{b_g\,\Psi}{N}, \qquad
# M_{optim} = \frac{K\,\Psi}{N}$$
#
# (`minizero.memory.estimate(..., frozen=Ψ_f)`). Stages 0-2 replicate them, as the paper and
# DeepSpeed do.
#
# Building the model is the other place a whole copy appears: a model constructed the usual way
# exists in full on every rank before `wrap` shards it. Under `with minizero.sharded_init():` each
# module's parameters are partitioned as soon as the module is built (`minizero/construct.py`), so a
# rank holds its chunks plus the module being built, never the whole model. Below: a Hugging Face
# GPT-2 with LoRA (peft), built both ways, trained one step at stage 3 with its decoder layers as
# units.

# %%
lora = demo.lora_memory(WORLD_SIZES, backend=BACKEND)         # one launch per N
for r in lora:
    print(f"N = {r['world_size']}: Ψ = {r['trainable']:,} trained, Ψ_f = {r['frozen']:,} frozen; "
          f"params {r['params']:,} B per rank (formula {r['formula']:,.0f}); building held "
          f"{r['construction_peak']['normal']:,} B normally, "
          f"{r['construction_peak']['sharded_init']:,} B sharded")
plots.lora_memory(lora);

# %% [markdown]
# ## What to try
#
# In the step-through, count the collectives per unit at stage 3 (two all-gathers, one
# reduce-scatter: the 3Ψ) against stage 2 (one reduce-scatter per bucket and one all-gather after
# the step: 2Ψ). In the unit timeline, compare the peak parameters with prefetch on and off; in the
# worker cell, set `PREFETCH = False` and see the same difference in `peak_params` on every rank. In
# the LoRA section, change the world sizes and watch the frozen parameters shrink as 1/N. Then do
# exercise 7: the four hooks that gather, free and reduce-scatter a unit; then exercise 8,
# the capstone.
