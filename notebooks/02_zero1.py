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
# # 02 · ZeRO stage 1 (P_os): shard the optimizer state
#
# The optimizer state (K = 12 of the 16 bytes per parameter for bf16 + Adam) is only ever used
# elementwise, so rank r can keep it for its own 1/N partition of the parameters
# (`minizero/zero1.py`):
#
# $$M_{P_{os}} = (b_p + b_g)\,\Psi + \frac{K\Psi}{N} \qquad (4\Psi + 12\Psi/N\text{ in the paper})$$
#
# All parameters are laid end to end in one flat buffer, padded to a multiple of N and cut into N
# partitions (`minizero/flat.py`). After backward a **reduce-scatter** gives rank r the averaged
# gradient of its partition (half an all-reduce: Ψ); it steps that partition; an **all-gather** (Ψ)
# shares the updated parameters. Total 2Ψ per step in a ring (what NCCL sends): the same as DDP. On
# gloo minizero runs the reduce-scatter as an all-reduce (faster there), so 3Ψ go on the wire: the
# worker cell below prints both figures, notebook 00 measures each collective.

# %% [markdown]
# **Exercise 04**: [`exercises/ex04_zero1_partition.py`](../exercises/ex04_zero1_partition.py),
# graded with `pytest exercises -k ex04`: padding, which slice each rank owns, the all-gather after
# the step.
#
# **Exercise 05**: [`exercises/ex05_clip_global_norm.py`](../exercises/ex05_clip_global_norm.py),
# graded with `pytest exercises -k ex05`: clipping by the global norm when each rank holds a
# partition of the gradients.

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
# how to read it), now at stage 1.
#
# What to look for: after backward every rank holds its own full gradients. The reduce-scatter
# averages partition r into rank r only: the rest of its gradient buffer was the collective's
# workspace (blank: nobody reads it again; on gloo minizero runs the reduce-scatter as an
# all-reduce, which is faster there, see `[Note: collectives on gloo]` in `minizero/comm.py`). The
# step updates partition r on rank r only, and only there does momentum exist (KΨ/N): for one phase
# the ranks hold *different* parameters, until the all-gather hands every rank every updated
# partition. 17 elements padded to a multiple of N: the last partition carries the padding.

# %%
from minizero.lab import stepthrough

steps = stepthrough.record(stepthrough.StepConfig(stage=1))      # one launch
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
# Stage 1 changes what happens at the step. `Engine.step` (`minizero/engine.py`) does three things,
# marked below: it asks the gradients for the parts this rank steps, steps them, and hands the
# updated partitions back to the parameters. At stage 1 the first is
# `GradientsReducedAtStep.parts` (`minizero/zero1.py`): it reduce-scatters each bucket of the full
# gradients backward left, in place, so rank r's partition holds the average (the reduce-scatter
# phases). The second is the heart of ZeRO-1, the **partitioned optimizer step**:
# `ShardOptimizer.step` (`minizero/optim.py`) runs torch's optimizer over what this rank was handed
# when the engine was built, its own partition of each bucket (Ψ/N elements:
# `ReplicatedParameters.optimizer_parts`, the essential line of P_os in `Engine.__init__`), so
# momentum exists for that partition only and only it changes (the step phase). The third,
# `ReplicatedParameters.after_step` (`minizero/ddp.py`), all-gathers every rank's updated partition
# into everyone's flat parameters (the all-gather phases). Marked: the lines that ran in the
# recording above and led to its phases (`stepthrough.ran`, from the events' call stacks);
# `optimizer_parts` ran when the engine was built, so it is shown unmarked.

# %%
from minizero.ddp import ReplicatedParameters
from minizero.lab import source

source.show(*stepthrough.ran(steps, "Engine.step", "GradientsReducedAtStep.parts",
                             "ShardOptimizer.step", "ReplicatedParameters.after_step"),
            ReplicatedParameters.optimizer_parts)

# %% [markdown]
# ## The code every rank runs
#
# The worker of notebook 01, [`ranks.py`](ranks.py), at stage 1: no option needed. Edit it and run
# the cell again: the next launch imports it as it is then.

# %%
import importlib

import minizero

import ranks

importlib.reload(ranks)               # your edits to ranks.py, in this kernel too
N = 2                                 # ranks: the optimizer bytes are 1/N of DDP's
for r in minizero.launch(ranks.train, N, 1, MODEL, backend=BACKEND):
    on_wire = "n/a" if r["on_wire"] is None else f"{r['on_wire']:,}"
    m = r["memory"]
    print(f"rank {r['rank']}: loss {r['losses'][-1]:.4f}, params {m['params']:,} B, "
          f"grads {m['grads']:,} B, optimizer {m['optimizer']:,} B, "
          f"last step sent {r['sent']:,.0f} B (ring model), {on_wire} B (on the wire)")

# %% [markdown]
# Change `N` to 4: the optimizer bytes per rank halve (KΨ/N), parameters and gradients stay.
#
# ### Partitions of one flat buffer, in this process
#
# `minizero.flat.FlatLayout` is the bookkeeping every stage shares: the parameters end to end in one
# flat buffer, padded to a multiple of N, cut into N equal partitions. A layout needs no process
# group: below, rank r's layout for each r of N, on the 17-parameter model of the step-through: the
# flat buffer of its parameters (`layout.flatten`) and rank r's partition of it
# (`layout.my_partition`, a view into the buffer), with the parameter each element belongs to (`·`:
# padding). Change `N` and run it again.

# %%
import torch
from torch import nn

from minizero.flat import FlatLayout

N = 4
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 2))           # Ψ = 17
names = [name for name, p in model.named_parameters() for _ in range(p.numel())]
for rank in range(N):
    layout = FlatLayout.build([list(model.parameters())], world_size=N, rank=rank)
    (b,) = layout.buckets
    flat = layout.flatten(torch.float32, torch.device("cpu"))   # Ψ values, then zeros up to N·⌈Ψ/N⌉
    part = layout.my_partition(flat, b)                         # this rank's partition: a view
    start = part.storage_offset()
    owners = (names + ["·"] * (b.padded_numel - b.numel))[start: start + part.numel()]
    print(f"rank {rank}: flat[{start:2}:{start + part.numel():2}] = {part.numpy().round(2)}  "
          f"{' '.join(owners)}")

# %% [markdown]
# ## Run it
#
# Every world size, measured against one process training on the whole batch, as in notebook 01:
# the same parameters, now with KΨ/N optimizer bytes per rank.

# %%
runs = demo.measure_stage(1, WORLD_SIZES, DTYPE, steps=STEPS, model=MODEL, backend=BACKEND)
for n, rec in runs.items():
    print(f"N = {n}: max |param - reference| = {rec['max_abs_diff']:.2e} "
          f"(tolerance {rec['tolerance']:g}), "
          f"loss {rec['losses'][0]:.3f} -> {rec['losses'][-1]:.3f}")

# %% [markdown]
# ## Measured memory next to the formula
#
# As in notebook 01: rank 0's bytes by category after the last backward, the formula's ticks, the
# check. New here: the optimizer bar is the only one that falls with N.

# %%
table = demo.memory_table(runs)          # what the plot draws, as rows
for row in table:
    if row["formula"] or row["measured"]:
        print(f"N = {row['world_size']}  {row['category']:>9}: "
              f"measured {row['measured'] / 1e3:8.1f} kB, formula {row['formula'] / 1e3:8.1f} kB")
demo.check(runs)                         # reference, memory and comm against the formulas
print("all ranks match the reference and the formulas")

# %%
plots.memory_by_category(runs, "stage 1");

# %% [markdown]
# ## What to try
#
# In the step-through, try N = 2, 3 and 4 and watch where the partition boundaries cut the
# parameters: a weight can straddle two ranks (as in DeepSpeed), and the padding moves with N. Check
# one stepped element by hand: new = old - 0.1 × averaged gradient (the momentum buffer is the
# gradient at the first step). Above, the optimizer bar falls as KΨ/N (K = 8 here: fp32 Adam's two
# moments, no separate master copy) while parameters and gradients stay. Then do exercise 4:
# partition the flat buffer and step only yours, and exercise 5: clip by the global norm.
