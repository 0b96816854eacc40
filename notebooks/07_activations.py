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
# # 07 · ZeRO-R: activations, checkpointing, and the whole memory of a step
#
# ZeRO-DP shards the model states; the other half of the paper (section 6, ZeRO-R) is what is left:
# *activations* (what a forward keeps for its backward), temporary buffers and fragmentation. For
# GPT-2 1.5B at sequence 1K and batch 32 the paper counts ~60 GB of activations (its rough $12 \cdot
# h \cdot b \cdot s$ per layer), ~8 GB with activation checkpointing, for ~33 % more compute.
#
# minizero measures them: `engine.memory()["activations"]` is the peak of the bytes saved for
# backward during the last step (autograd's saved-tensor hooks, each storage once, parameters left
# out; `minizero/beyond/activations.py`). `minizero.memory.activation_bytes` predicts them for
# minizero's GPT, term by term: per block $e \cdot s \cdot b \cdot ((8 + 2r)h + a \cdot s + 4) +
# s^2$. `wrap(..., activation_checkpointing=True)` keeps only each block's input ($e \cdot s \cdot b
# \cdot h$) and recomputes the block in backward; `"cpu"` keeps those inputs in host memory (the
# paper's P_a+cpu; P_a itself partitions what *model* parallelism replicates, which pure data
# parallelism does not have).

# %% [markdown]
# **Exercise 11**: [`exercises/ex11_checkpoint_unit.py`](../exercises/ex11_checkpoint_unit.py),
# graded with `pytest exercises -k ex11`: checkpoint a unit: keep only its inputs and recompute it
# in backward.

# %% tags=["parameters"]
from minizero.lab import demo
import plots                                  # notebooks/plots.py: the figures

MODEL, STEPS = "default", 10     # the small GPT, ~0.2 M parameters; "tiny": a few thousand
DTYPE = "fp32"     # or "bf16": the paper's 2 + 2 + 12 bytes per parameter (looser reference check)
BACKEND, WORLD_SIZES = demo.backend_and_world_sizes()   # gloo on CPU; NCCL with 2 or more GPUs
SEQS, BATCHES = (8, 16, 32), (2, 4, 8)      # the activation sweep: sequence lengths, rows

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
# What to look for here: the title of each phase gives the bytes each rank has saved for backward at
# that moment (`engine.activations.alive`). They rise through forward and fall to zero through
# backward; with checkpointing on, every unit keeps only its input and is recomputed in backward, at
# stage 3 after its parameters were gathered for it. Switch checkpointing off and compare the peak:
# for this tiny model checkpointing keeps *more*, because a Linear saves nothing but its input
# anyway. It pays off for units whose forward saves much more than their input, like the transformer
# blocks measured below.

# %%
from minizero.lab import stepthrough

steps = stepthrough.record(stepthrough.StepConfig(stage=3, checkpointing=True))      # one launch
stepthrough.check(steps)       # every phase against one process stepping all 12 rows
print(plots.step_table(steps))           # every phase: each buffer that changed, on every rank

# %% [markdown]
# Press play or drag the slider through the phases. A menu records the step again with another
# setting (one launch, about a second; each setting is kept once computed).

# %%
plots.step_widget(steps, checkpointing=[True, False], stage=[0, 1, 2, 3], world_size=[2, 3, 4])

# %% [markdown]
# ## Measured next to the estimate, across sequence length and micro-batch
#
# One process is enough: a rank's activations depend on its own micro-batch, not on N or the stage.

# %%
rows = demo.activation_sweep(MODEL, SEQS, BATCHES)
for r in rows:
    assert abs(r["measured"] - r["estimate"]) <= 0.1 * r["estimate"], r
print(f"{'checkpointing':>14} {'s':>3} {'b':>3} {'measured kB':>12} {'estimate kB':>12}")
for r in rows:
    print(f"{str(r['checkpointing']):>14} {r['seq']:>3} {r['batch']:>3} "
          f"{r['measured'] / 1e3:12.1f} {r['estimate'] / 1e3:12.1f}")
plots.activation_sweep(rows);

# %% [markdown]
# Without checkpointing the activations grow with $s \cdot b$ and, through the attention scores,
# with $a \cdot s^2 \cdot b$; checkpointed, the blocks keep $s \cdot b \cdot h$ each, plus one block
# while backward recomputes it.
#
# ## Every stage, with and without checkpointing: model states + activations
#
# One launch per world size trains all eight runs; each is checked against the single-process
# reference and the model states against the paper's formulas, as in the other notebooks.

# %%
from minizero.lab.train import TrainConfig
variants = {(s, ckpt): TrainConfig(stage=s, dtype=DTYPE, steps=STEPS, model=MODEL, batch_size=24,
                                   activation_checkpointing=ckpt)
            for s in range(4) for ckpt in (False, True)}
measured = demo.measure(variants, WORLD_SIZES, BACKEND)      # {(stage, checkpointing): {N: record}}
for runs in measured.values():
    demo.check(runs)
N = WORLD_SIZES[-1]
for (s, ckpt), runs in measured.items():
    m = runs[N]["ranks"][0]["memory"]
    states = m["params"] + m["grads"] + m["optimizer"]
    print(f"stage {s}, checkpointing {str(ckpt):5}: model states {states / 1e3:7.1f} kB, "
          f"activations {m['activations'] / 1e3:7.1f} kB, "
          f"step {runs[N]['step_time_s'] * 1e3:6.1f} ms")
plots.full_memory({key: runs[N] for key, runs in measured.items()});

# %% [markdown]
# The step times above are the recompute's cost: one more forward of every block per step (the
# paper's ~33 %; on CPU processes sharing two cores the measurement is noisy, and Python's overhead
# per block weighs more on a small model).
#
# ## One step, event by event
#
# `with engine.memory_timeline() as timeline:` records the bytes by category at each event: the end
# of a block's forward, the start of its backward, a gradient bucket launched and arrived, the step.
# Activations rise block by block through forward and fall in reverse through backward; stage 3
# gathers each block's parameters for its backward and frees them after.

# %%
timelines = demo.memory_timelines((0, 3), N, MODEL, BACKEND)
plots.memory_timeline(timelines);

# %% [markdown]
# ## The rest of ZeRO-R in minizero's code
#
# - **Constant-size buffers (C_B).** A fused buffer of all gradients grows with the model (the
#   paper: 12 GB for 3 B parameters in fp32); gradients are reduced in buckets of at most
#   `bucket_size` bytes instead (`minizero.flat.split_into_buckets`, default
#   `minizero.flat.DEFAULT_BUCKET_BYTES` = 25 MB, PyTorch DDP's `bucket_cap_mb`), and at most two
#   are in flight (`minizero.reducer.GradBuckets`).
# - **Memory defragmentation (M_D).** Long-lived tensors live in preallocated contiguous buffers
#   (`minizero/flat.py`: parameters and gradients as views of one flat buffer per bucket; stage 3's
#   `minizero.zero3.Unit`'s `full`); short-lived gradients are copied into their bucket's buffer
#   the moment they are complete (`minizero.zero2.GradientShard.contiguous_gradients`), so they
#   never interleave with activations.

# %% [markdown]
# ## What to try
#
# In the step-through, turn checkpointing off and on at stage 0 and at stage 3 and compare the bytes
# saved for backward phase by phase. In the sweep, add a longer sequence to `SEQS` (64, say) and
# watch the attention term $a \cdot s^2 \cdot b$ take over without checkpointing. In the timeline,
# compare stage 0 and stage 3 with checkpointing: the parameters rise and fall with each block's
# backward only at stage 3. Then do exercise 11: checkpoint a unit yourself.
