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
# # 05 · Offload: the optimizer on the host
#
# ZeRO-Offload moves what is only touched once per step, the optimizer, into host (CPU) memory
# (`minizero/offload.py`). Per step rank r copies its averaged gradient partition to the host (Ψ/N),
# the CPU steps the fp32 master weights with Adam, and the updated partition is copied back (Ψ/N).
# With stage 2, per rank:
#
# $$M_{device} = b_p\,\Psi + \frac{b_g\,\Psi}{N}, \qquad
#   M_{host} = \frac{(K + 4)\,\Psi}{N}$$
#
# where K counts the fp32 master weights and Adam's two moments (12) and 4 is the fp32 gradient
# partition the host steps on. With stage 3, `offload="params"` keeps the parameter shard on the
# host too, and each gather first copies the unit's partition to the device: $M_{device} =
# b_g\Psi/N$ (plus units in flight).
#
# On this CPU-only machine "device" and "host" are the same RAM, but the code path is the same as on
# a GPU (separate host buffers, explicit copies), so the accounting is exactly what a GPU would see.

# %% [markdown]
# **Exercise 09**: [`exercises/ex09_offload_step.py`](../exercises/ex09_offload_step.py), graded
# with `pytest exercises -k ex09`: the host-side optimizer step: gradients down, the step there,
# parameters back up.
#
# **Exercise 10**: [`exercises/ex10_global_overflow.py`](../exercises/ex10_global_overflow.py),
# graded with `pytest exercises -k ex10`: the global overflow check of fp16's loss scale: one
# collective over the ranks' flags (this notebook's last section).

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
# how to read it), now at stage 2 with the optimizer offloaded: rows marked (host) live in host
# memory.
#
# What to look for: with the optimizer offloaded, the master weights, the momentum and an fp32 copy
# of the gradient partition live in host memory (the rows marked host). At the step, rank r copies
# its averaged gradient partition down (*gradients (host)*), the CPU steps the host master weights,
# and the updated partition is copied up into the device parameters, which the all-gather then
# shares. The device keeps parameters and the gradient shard only.

# %%
from minizero.lab import stepthrough

steps = stepthrough.record(stepthrough.StepConfig(stage=2, offload=True))      # one launch
stepthrough.check(steps)       # every phase against one process stepping all 12 rows
print(plots.step_table(steps))           # every phase: each buffer that changed, on every rank

# %% [markdown]
# Play or drag through the phases; below each, the function of minizero that produced it, its line
# marked.

# %%
plots.step_widget(steps, stage=[1, 2, 3], world_size=[2, 3, 4], offload=[True, False])

# %% [markdown]
# ### The lines that did it
#
# Offload changes only where the optimizer's tensors live and two copies (`minizero/offload.py`,
# `minizero/optim.py`): `HostShardOptimizer._grads_for_masters` copies this rank's averaged
# gradient partition into host buffers (*gradients (host)*), `ShardOptimizer.step` steps the
# host's fp32 masters (marked: the line that ran in the recording above, found on the optimizer
# step's call stack) and then copies each updated partition back into the device parameters,
# which stage 2's all-gather shares. `_grads_for_masters` ran just before, in the loop's header;
# no event's stack passes through it, so it is shown unmarked.

# %%
from minizero.lab import source
from minizero.offload import HostShardOptimizer

source.show(HostShardOptimizer._grads_for_masters, *stepthrough.ran(steps, "ShardOptimizer.step"))

# %% [markdown]
# ## The code every rank runs
#
# The worker of notebook 01, [`ranks.py`](ranks.py), at stage 2 with `offload="optimizer"`: the same
# loop, the engine keeps the optimizer on the host.

# %%
import importlib

import minizero

import ranks

importlib.reload(ranks)               # your edits to ranks.py, in this kernel too
N, OFFLOAD = 2, "optimizer"          # ranks; False: the optimizer stays on the device
for r in minizero.launch(ranks.train, N, 2, MODEL, {"offload": OFFLOAD, "dtype": DTYPE},
                         backend=BACKEND):
    on_wire = "n/a" if r["on_wire"] is None else f"{r['on_wire']:,}"
    m = r["memory"]
    print(f"rank {r['rank']}: loss {r['losses'][-1]:.4f}, params {m['params']:,} B, "
          f"grads {m['grads']:,} B, optimizer {m['optimizer']:,} B, host {m['offloaded']:,} B, "
          f"last step sent {r['sent']:,.0f} B (ring model), {on_wire} B (on the wire)")

# %% [markdown]
# Set `OFFLOAD = False`: the optimizer bytes come back to the device and the host holds nothing. Set
# `DTYPE = "bf16"` in the first cell: the device's parameters and gradients halve, the host keeps
# fp32.
#
# ### Device and host bytes, in this process
#
# The same accounting on one process (N = 1): `engine.memory()` after one step, with the optimizer
# on the device and offloaded. Offloaded, the host holds the fp32 master weights, Adam's two moments
# and the fp32 gradient partition it steps on: (K + 4)Ψ/N bytes, plus AdamW's 4-byte step count
# (notebook 01); the device holds no optimizer state.

# %%
import functools

import torch
from torch import nn

for offload in (False, "optimizer"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 2))       # Ψ = 17
    engine = minizero.wrap(model, 2, functools.partial(torch.optim.AdamW, lr=0.1), offload=offload)
    engine.backward(engine(torch.randn(4, 2)).pow(2).mean())
    engine.step()
    m = engine.memory()
    print(f"offload={offload!r:>11}: device: params {m['params']} B, grads {m['grads']} B, "
          f"optimizer {m['optimizer']} B; host {m['offloaded']} B")

# %%
from minizero.lab.train import TrainConfig
base = dict(dtype=DTYPE, steps=STEPS, model=MODEL, batch_size=24)
variants = {"stage 2": TrainConfig(stage=2, **base),
            "stage 2 + offload": TrainConfig(stage=2, offload="optimizer", **base),
            "stage 3 + offload params": TrainConfig(stage=3, offload="params", **base)}
measured = demo.measure(variants, WORLD_SIZES, BACKEND)    # one launch per N, all three variants
for name, runs in measured.items():
    demo.check(runs)                     # reference, memory (device and host) and comm vs formulas
    worst = max(rec["max_abs_diff"] for rec in runs.values())
    print(f"{name:>25}: max |param - reference| over all N = {worst:.2e}")

# %% [markdown]
# ## Device vs host bytes
#
# Left, what stays on the compute device; right, what moved to the host. The black ticks are
# `minizero.memory.estimate_breakdown`. Offload trades device memory for host memory and two
# copies of Ψ/N per step.

# %%
plots.device_vs_host(measured, "Offload: device vs host model-state bytes per rank (rank 0)");

# %%
plots.memory_by_category(measured["stage 2 + offload"], "stage 2 + offload");

# %% [markdown]
# ## fp16: dynamic loss scaling, and why the overflow check is global
#
# The paper's 2 + 2 + K bytes are fp16 mixed precision (`dtype="fp16"`, `minizero/loss_scale.py`).
# fp16 flushes magnitudes below ~6e-8 to zero, where many gradients live, so backward runs on the
# loss times a scale S (every gradient S times larger, by the chain rule) and the step divides by S
# again, in fp32, before clipping and the optimizer. S is *dynamic* (DeepSpeed's defaults: $2^{16}$,
# window 1000, hysteresis 2): a step whose gradients hold an inf or a nan is **skipped** (no
# optimizer step, its state untouched) and S backs off; `hysteresis` - 1 overflows are tolerated at
# the same S first, a credit that only a growth restores; a good step that follows
# `loss_scale_window` good steps in a row doubles S after it (DeepSpeed counts the good steps
# *before* the current one).
#
# With ZeRO the check is where sharding bites: after the reduce-scatter each rank holds only its
# partition of the gradients, so an inf lands on **one** rank. Decided locally, that rank would skip
# the step and the others take it, and their parameters and scales part ways for good. So each
# rank's 0/1 flag goes through one all-reduce (max) and every rank takes the same decision.
#
# Below: stage 2, an inf injected into one element of one rank's partition at steps 3, 4, 5 and 12
# (of ranks 1, 0, 1 and 1: `FAULTS`; the experiment's fault, `minizero.lab.demo.loss_scale_worker`).
# Window 4, hysteresis 2: step 3 uses up the credit, steps 4 and 5 halve S; steps 6-9 are 4 good
# steps, so the 5th good step, step 10, doubles S after it (step 11 is the first to use it), which
# restores the credit, so step 12 is skipped at the same S.

# %%
FAULTS = {3: 1, 4: 0, 5: 1, 12: 1}       # step: the rank whose gradient partition gets an inf
SCALING = {"initial_scale_power": 10, "loss_scale_window": 4, "hysteresis": 2}
fp16 = demo.loss_scale_run(max(WORLD_SIZES), FAULTS, SCALING, steps=16, stage=2, backend=BACKEND)
for res in fp16["ranks"]:
    print(f"rank {res['rank']}: skipped {[t['step'] for t in res['trace'] if t['skipped']]}, "
          f"own partition overflowed at {[t['step'] for t in res['trace'] if t['local_overflow']]}")
decisions = {r["rank"]: [(t["scale"], t["skipped"]) for t in r["trace"]] for r in fp16["ranks"]}
assert all(d == decisions[0] for d in decisions.values()), "the ranks took different decisions"
plots.loss_scale_trajectory(fp16);

# %% [markdown]
# ## What to try
#
# In the step-through, turn offload off and on at the same stage: the host rows appear and the
# device keeps no optimizer state; at stage 3 the parameter shard stays on the device here
# (`offload="params"` would move it too). In the fp16 section, change `FAULTS` so two ranks overflow
# in the same step, or `SCALING["hysteresis"]` to 1, and predict the trajectory before you run it.
# Then do exercises 9 (the host step) and 10 (the global overflow check).
