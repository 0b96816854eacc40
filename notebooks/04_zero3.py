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
# (backward) + reduce-scatter Ψ = **3Ψ**, 1.5× DDP, the price of not replicating parameters (in a
# ring; on gloo's wire 4Ψ, as its reduce-scatter is an all-reduce: notebook 00).

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
# The same tiny model, recorder and grid as in notebook 01 (its "One step, rank by rank" explains
# how to read it), now at stage 3: each Linear is a unit, and the parameters row is what is gathered
# at that moment.
#
# What to look for: between uses a rank holds only its *parameter shard* (phase [0]: the
# parameters row is empty, every rank holds partition r of each unit); the parameters row fills only
# while a unit is gathered. Each unit is all-gathered for its forward and freed, gathered again for
# its backward, its gradients reduce-scattered into the gradient shard, and freed. The step updates
# the shard in place and nothing is gathered after it: the next forward gathers what it needs.
# Prefetch is on: in backward, as unit l2 is gathered, the all-gather of unit l1, next in
# backward's order, starts too (the phase marked "a prefetch"). In forward it starts from the
# second step: the first step records the order the units run in. (The recorder lets each
# collective complete as it is issued, so the prefetch is its own phase; in a real step it is in
# flight while l2 computes.)

# %%
from minizero.lab import stepthrough

steps = stepthrough.record(stepthrough.StepConfig(stage=3))      # one launch
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
# Stage 3 is what happens to a unit (`minizero/zero3.py`). The module's forward pre-hook calls
# `pre_forward`, which gathers the unit (and, from the second step, prefetches the next one);
# `gather` allocates the unit's full buffer and all-gathers every rank's shard into it (the
# all-gather phases); the forward hook calls `post_forward`, which frees it (the free phases: the
# storage goes back, 0 bytes, the shape kept). In backward a hook on the unit's output calls
# `pre_backward`: gather again, and `_prefetch` starts the next unit's all-gather. When the unit's
# gradients are complete, `post_backward` hands its bucket to stage 2's `GradientShard.reduce`,
# whose marked line is the reduce-scatter itself (the reduce-scatter phases), and frees the unit.
# Marked: the lines that ran in the recording above and led to its phases (`stepthrough.ran`, from
# the events' call stacks); a line of `pre_forward` that did not run here stays unmarked.

# %%
from minizero.lab import source

source.show(*stepthrough.ran(steps, "Unit.pre_forward", "Unit.post_forward", "Unit.pre_backward",
                             "Unit._prefetch", "Unit.gather", "Unit.post_backward",
                             "GradientShard.reduce"))

# %% [markdown]
# ## The code every rank runs
#
# The worker of notebook 01, [`ranks.py`](ranks.py), at stage 3 with `prefetch`. Besides rank 0's
# bytes, the cell sizes the units in this process (the model built here only to count them), to
# say what the peak of the parameters consists of.

# %%
import importlib

import minizero
from minizero.lab.model import GPTConfig, make_model

import ranks

importlib.reload(ranks)               # your edits to ranks.py, in this kernel too
N, OPTIONS = 2, {"prefetch": True}    # ranks; gather the next unit while this one computes
net = make_model(GPTConfig.named(MODEL))                   # here only to size the units (fp32)
block = 4 * sum(p.numel() for p in net.blocks[0].parameters())           # one block's unit
whole = 4 * sum(p.numel() for p in net.parameters())                     # 4Ψ, the tied weight once
root = whole - block * len(net.blocks)      # the root unit: embeddings, final LayerNorm, the head
for r in minizero.launch(ranks.train, N, 3, MODEL, OPTIONS, backend=BACKEND):
    on_wire = "n/a" if r["on_wire"] is None else f"{r['on_wire']:,}"
    m = r["memory"]
    gathered = m["peak_params"] - m["params"]
    print(f"rank {r['rank']}: loss {r['losses'][-1]:.4f}, params {m['params']:,} B (the shard), "
          f"grads {m['grads']:,} B, optimizer {m['optimizer']:,} B, "
          f"last step sent {r['sent']:,.0f} B (ring model), {on_wire} B (on the wire)\n"
          f"    parameters at most {m['peak_params']:,} B = the shard + {gathered:,} B gathered "
          f"at once: the root unit ({root:,} B) + {(gathered - root) / block:.2f} blocks of "
          f"{block:,} B; the whole model is {whole:,} B")

# %% [markdown]
# The peak of the parameters is the shard plus what is gathered at once: the root unit, which stays
# gathered through the whole forward and again through the whole backward (the model is its
# module: its hooks fire first and last), the block computing, and with prefetch the next block. At
# N = 2 with 4 blocks that can exceed the whole model: half the model in the shard, plus the root
# and two of the four blocks. Stage 3 pays off as N and the number of units grow: the shard is
# 4Ψ/N, the gathered part stays about two units whatever N. Change `N` to 4: every category is
# 1/N, the gathered part does not move. Set `OPTIONS = {"prefetch": False}`: one block fewer. (The
# optimizer's few bytes over 2 × 4Ψ/N are AdamW's step counts, 4 bytes per unit: notebook 01.)
#
# ### A unit's storage, in this process
#
# Stage 3 keeps a unit's full parameters only while it computes. Below, on one process (N = 1, no
# communication), a model wrapped at stage 3 with each `Linear` a unit, and two forward hooks of our
# own on the last unit: the bytes of its weight's storage before the forward, while the unit runs
# and after. The engine's own hooks, registered first, gather before ours and free before our
# post-hook sees it. Change `UNITS` to `[model[0], model[2]]` (the last Linear then belongs to the
# model's root unit, which stays gathered through the whole forward) and run it again.

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
# 32 bytes while the unit runs: the weight is a view of the unit's whole gathered buffer, the
# weight's 2 × 3 (out × in, `nn.Linear(3, 2)`) and the bias's 2 fp32 elements. 4 bytes otherwise,
# not 0: a released parameter points at one NaN element of its own, expanded to its shape
# (`Unit.__init__`'s `absent` in `minizero/zero3.py`; why: `[Note: absent parameters]` in
# `minizero/absent.py`), so that reading it gives NaN instead of freed memory (notebook 09,
# section 2). Its shape stays ((2, 3) here) and so does `numel()`.

# %% [markdown]
# ## Run it
#
# Every world size, measured against one process training on the whole batch, as in notebooks
# 01-03: the same parameters, with every model-state category now 1/N per rank.

# %%
runs = demo.measure_stage(3, WORLD_SIZES, DTYPE, steps=STEPS, model=MODEL, backend=BACKEND)
for n, rec in runs.items():
    print(f"N = {n}: max |param - reference| = {rec['max_abs_diff']:.2e} "
          f"(tolerance {rec['tolerance']:g}), "
          f"loss {rec['losses'][0]:.3f} -> {rec['losses'][-1]:.3f}")

# %% [markdown]
# ## Measured memory next to the formula
#
# As in notebook 01: rank 0's bytes by category after the last backward (every unit freed by
# then), the formula's ticks, the check. New here: the parameters bar falls with N too.

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
#
# Read the bars for *when* each unit exists, not the two panels' lengths for speed (both panels
# share one time axis; the cell prints each step's length). Here the network is loopback between
# processes on the same cores: an all-gather of a unit takes about as long as the Python around it,
# so prefetch has little waiting to hide, and what else the machine runs decides the lengths. Three
# runs of this cell's launch at N = 4 on this project's shared 2-core machine gave (prefetch off,
# on) = (230, 148), (113, 472) and (342, 109) ms: the lengths vary more from run to run than from
# one setting to the other. Notebook 08 runs stage 3 on a modelled network
# (`minizero/beyond/network.py`), where an all-gather takes a real link's time and prefetch's
# overlap shows as time saved.

# %%
timelines = demo.zero3_timelines(max(WORLD_SIZES), model=MODEL, backend=BACKEND)   # one launch
intervals = {p: demo.unit_intervals(rec) for p, rec in timelines.items()}
for p, ivs in intervals.items():
    names = timelines[p]["unit_names"]
    for b, name in enumerate(names):   # every unit: gathered once for forward, once for backward
        assert [iv["phase"] for iv in ivs if iv["unit"] == b] == ["forward", "backward"], name
    print(f"prefetch {'on ' if p else 'off'}: {len(ivs)} gather->free spans over "
          f"{len(names)} units, peak parameters {timelines[p]['peak_params'] / 1e3:.1f} kB, "
          f"step {timelines[p]['marks']['end'] * 1e3:.0f} ms")
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
# Both builds are measured the same way: the parameter bytes alive at once while the model is built
# (`minizero.lab.demo.ParameterBytes` for the normal build, `sharded_init`'s own count for the
# other). The normal build holds the whole model at the end, base and adapters. At N = 1 building
# under `sharded_init` holds *more* (223,488 B against 215,296 B): one rank's chunks are the whole
# model, and transformers initializes each weight after its module is built, a call that gathers
# the weight in full. The peak comes during that pass over the base model: its chunks (207,104 B)
# plus one MLP weight of 32 × 128 fp32 elements (16,384 B). The LoRA adapters (2,048 parameters,
# 8,192 B) are built only after it, so the gap is 16,384 - 8,192 = 8,192 B. From N = 2 the chunks
# are 1/N of the model, and that saving outgrows the one weight in flight.

# %% [markdown]
# ## What to try
#
# In the step-through, count the collectives per unit at stage 3 (two all-gathers, one
# reduce-scatter: the 3Ψ) against stage 2 (one reduce-scatter per bucket and one all-gather after
# the step: 2Ψ). In the unit timeline, compare the peak parameters with prefetch on and off; in the
# worker cell, set `OPTIONS = {"prefetch": False}` and see the same difference in `peak_params` on
# every rank. In
# the LoRA section, change the world sizes and watch the frozen parameters shrink as 1/N. Then do
# exercise 7: the four hooks that gather, free and reduce-scatter a unit; then exercise 8,
# the capstone.
