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
# # 10 · Tensor parallelism, and ZeRO on a 2-D mesh
#
# ZeRO shards what data parallelism *replicates*: the model states. For its largest models the
# paper combines it with Megatron's *model parallelism* (Shoeybi et al., 2019): M ranks inside a
# node each hold 1/M of every block's weights and compute 1/M of its matmuls, and ZeRO's N_d-way
# data parallelism runs across the nodes. N = N_m × N_d ranks form a mesh: tensor parallelism
# along a row of M = N_m consecutive ranks, ZeRO along a column. Every formula of the paper then
# holds with Ψ/M for Ψ and N_d for N; at stage 3 a rank holds
#
# $$\frac{(2 + 2 + K)\,\Psi}{N_m \cdot N_d},$$
#
# and the paper's Table 1 (`python -m minizero.memory --table1`) lists the largest model each
# stage fits per N_m. What the M ranks of a row send each other is activations, not model states:
# two all-reduces of a block's output $[b, s, h]$ forward, two of its input gradient backward.
# And one optimization of ZeRO-R, **P_a**, exists only here: the M ranks of a row hold the same
# checkpointed block inputs, so each keeps 1/M of them.
#
# The implementation is `minizero/beyond/tensor_parallel.py` (the layers, f and g);
# `wrap(..., tensor_parallel=M)` builds the mesh; docs/tensor_parallel.md has the rest.

# %% [markdown]
# **Exercise 15**:
# [`exercises/ex15_tensor_parallel_linear.py`](../exercises/ex15_tensor_parallel_linear.py), graded
# with `pytest exercises -k ex15`: write the column- and row-parallel layers, forward and backward.

# %% tags=["parameters"]
import mesh_plots                   # notebooks/mesh_plots.py: this notebook's figures
from minizero.lab import mesh_demo, source
from minizero.lab.train import TrainConfig

HIDDEN, ROWS = 8, 4                        # the column/row pair alone: X is [ROWS, HIDDEN]
MODEL, STEPS, BATCH = "default", 3, 8      # the small GPT (4 heads, vocabulary 12) on the mesh
MESHES = ((1, 4), (2, 2), (4, 1))          # (N_m, N_d): N = 4 ranks cut three ways
STAGES = (0, 1, 2, 3)

# %% [markdown]
# ## Tensor parallelism alone: a column-parallel layer, then a row-parallel one
#
# Megatron splits a transformer's MLP $Y = \mathrm{GELU}(XA)\,B$ without any collective between
# the two matmuls. $A$ is split by **columns** (its outputs): rank i computes
# $\mathrm{GELU}(XA_i)$, its 4h/M of the hidden units, from the whole $X$ (GELU is elementwise:
# it needs nothing from the others). $B$ is split by **rows** (its inputs): rank i multiplies
# its slice by $B_i$ and gets a *partial sum* of the whole output, $Y = \sum_i
# \mathrm{GELU}(XA_i)B_i$. Two collectives make it exact, named f and g in the Megatron paper,
# each the mirror of the other:
#
# - **f**, before the column-parallel layer. Forward: the identity (every rank needs the whole
#   X). Backward: an all-reduce (each rank's $\partial L/\partial X$ is a partial sum over its
#   4h/M hidden units).
# - **g**, after the row-parallel layer. Forward: an all-reduce (add the M partial sums).
#   Backward: the identity ($\partial L/\partial Y$ is whole on every rank already).
#
# Here they are in minizero's file, read from it now:

# %%
from minizero.beyond import tensor_parallel
source.show(tensor_parallel.ColumnParallelLinear.forward, tensor_parallel.RowParallelLinear.forward,
            tensor_parallel._CopyToGroup.backward, tensor_parallel._ReduceFromGroup.forward,
            mark=("<- f", "<- g", "all_reduce("))

# %% [markdown]
# Two processes, each with its half of A and B, next to the whole pair on one process (the same
# weights, the same X, the same output gradient): the output, the input's gradient and each
# weight's gradient (the rank's slice of the whole one).

# %%
pair = mesh_demo.column_then_row(HIDDEN, ROWS)
for r in pair:
    print(f"rank {r['rank']}: A_i {r['shapes']['column weight']}, B_i {r['shapes']['row weight']}")
    for name, diff in r["diffs"].items():
        print(f"    {name:24} max |split - whole| = {diff:.1e}"
              f"{'  (bitwise equal)' if r['bitwise'][name] else ''}")
    assert max(r["diffs"].values()) < 1e-6
print("\nthe collectives of one forward and backward, rank 0:")
for phase in pair[0]["phases"]:
    print(f"  {phase['tag']:20} {phase['kind']} of {phase['numel']} numbers over ranks "
          f"{phase['group']}  <- {phase['source']['file']}:{phase['source']['line']} "
          f"{phase['source']['function']}")

# %% [markdown]
# One all-reduce forward (g) and one backward (f), each of $[b, h]$ numbers: the activations'
# size, whatever the size of A and B. The weight gradients are bitwise equal (each rank computes
# its slice from the same numbers); the output and the input gradient differ in the last bits,
# because g adds two partial sums where one process adds all 4h products in one matmul.
#
# ## Tensor parallelism × ZeRO: every stage on every mesh of 4 ranks
#
# `wrap(model, stage, optimizer, tensor_parallel=M)` splits minizero's GPT over each row of M
# ranks (`tensor_parallel.parallelize_gpt`: attention's qkv and the MLP's first layer
# column-parallel, their second layers row-parallel, the vocabulary split, the loss from the
# vocabulary slices) and runs the stage along each column of N_d = N/M ranks. One launch of 4
# processes trains every (mesh, stage); each rank's part ends within rounding of one process
# training the whole GPT, split as that rank holds it.

# %%
variants = {(m, s): TrainConfig(stage=s, world_size=m * n_d, tensor_parallel=m, model=MODEL,
                                steps=STEPS, batch_size=BATCH)
            for m, n_d in MESHES for s in STAGES}
runs = mesh_demo.measure_meshes(variants)
for (m, s), r in runs.items():
    assert r["max_abs_diff"] <= r["tolerance"], ((m, s), r["max_abs_diff"])
print(f"{'mesh':>6} {'stage':>6} {'Ψ per rank':>11} {'params kB':>10} {'grads kB':>9} "
      f"{'optim kB':>9} {'formula kB':>11} {'max |Δθ|':>9}")
for (m, s), r in runs.items():
    mem, th = r["ranks"][0]["memory"], r["theory"]
    print(f"{mesh_plots.mesh_name(r):>6} {s:>6} {r['num_params']:>11,} "
          f"{mem['params'] / 1e3:>10.1f} {mem['grads'] / 1e3:>9.1f} {mem['optimizer'] / 1e3:>9.1f} "
          f"{th['device_total'] / 1e3:>11.1f} {r['max_abs_diff']:>9.1e}")
mesh_plots.memory_across_the_mesh(list(runs.values()));

# %% [markdown]
# Ψ per rank is the rank's part of the model: 1/M of the split weights plus everything that stays
# whole in a row (LayerNorms, position embeddings, the row-parallel layers' biases), which is why
# 4 × 1 holds a little more than Ψ/4. The formula (black ticks) is the paper's with that Ψ and
# N_d: `estimate_breakdown(Ψ_rank, N_d, stage)`; the measured bars end on it (a few bytes of
# padding apart). Along a row the stages change nothing (DDP at 4 × 1 holds the same as
# stage 3 there: N_d = 1); along a column they divide as on pure data parallelism.
#
# ## One step on the 2 × 2 mesh, rank by rank
#
# A GPT of two tiny blocks (h = 8, 2 heads) at stage 3 on ranks 0-3: rows {0, 1} and {2, 3} split
# the model, columns {0, 2} and {1, 3} shard each row's part with ZeRO. The recorder
# (`mesh_demo.Recorder`) subscribes to minizero's event stream and notes every collective each rank
# issues, what the buffer held before and after (its first values), and the line of minizero that
# issued it. Watch the two axes take turns: the column all-gathers a block's parameters (zero3.py),
# then the row runs that block's g's forward and f's backward (beyond/tensor_parallel.py), then the
# column reduce-scatters the block's gradients. Every g leaves each rank of a row the *sum* of
# the row's partials; the replay below checks every one from the ranks' own records.

# %%
steps = mesh_demo.record_block(stage=3, mesh=(2, 2))
mesh_demo.check_block(steps)
for k, phase in enumerate(steps["ranks"][0]):
    print(f"{k + 1:>3} {phase['kind']:>15} {phase['tag']:26} over {phase['group']}  <- "
          f"{phase['source']['file']}:{phase['source']['line']} {phase['source']['function']}")

# %% [markdown]
# Drag the slider through the step: each rank's part of the collective, and the function of
# minizero that issued it, its line marked (the forward g's are
# `_ReduceFromGroup.forward`, the backward f's `_CopyToGroup.backward`; f's forward and g's
# backward are identities and issue nothing).

# %%
from ipywidgets import IntSlider, interact
interact(lambda collective: mesh_plots.show_phase(steps, collective - 1),
         collective=IntSlider(min=1, max=len(steps["ranks"][0]), value=1));

# %% [markdown]
# ## P_a: partitioned activation checkpoints, measured
#
# With checkpointing, each block keeps only its input $[b, s, h]$ and recomputes the rest in
# backward. On a row of M ranks that input is the same on all of them: M replicas. P_a
# (`activation_checkpointing="partitioned"`) keeps each rank's 1/M of it and all-gathers it
# before the recompute; P_a+cpu (`"partitioned+cpu"`) keeps that 1/M in host memory. The
# activation meter (`engine.memory()["activations"]`) measures the bytes saved for backward; the
# estimate is `minizero.memory.activation_bytes(..., tensor_parallel=M, checkpointing=...)`.

# %%
from minizero.lab.data import sequence_length
from minizero.memory import activation_bytes
modes = {("P_a", c): TrainConfig(stage=3, world_size=4, tensor_parallel=2, model=MODEL,
                                 steps=STEPS, batch_size=BATCH, activation_checkpointing=c)
         for c in (False, "partitioned", "partitioned+cpu")}
checkpointed = list(mesh_demo.measure_meshes(modes).values())
estimates = {}
for r in checkpointed:
    cfg, mode = r["model"], r["activation_checkpointing"]
    rows = r["batch_size"] // (r["world_size"] // r["tensor_parallel"])
    estimates[str(mode)] = activation_bytes(
        cfg["n_layer"], cfg["n_embd"], cfg["n_head"], sequence_length(cfg["block_size"]), rows,
        mlp_ratio=cfg["mlp_ratio"], checkpointing=mode, tensor_parallel=r["tensor_parallel"])
    measured = r["ranks"][0]["memory"]["activations"]
    print(f"{str(mode):>16}: measured {measured / 1e3:8.1f} kB, estimate "
          f"{estimates[str(mode)] / 1e3:8.1f} kB")
mesh_plots.activations(checkpointed, estimates);

# %% [markdown]
# Without checkpointing a rank keeps its split block tensors (1/M of q, k, v, the scores and the
# MLP's hidden units) and the whole LayerNorm inputs; P_a keeps L·(e·b·s·h)/M of block inputs, plus
# one block while backward recomputes it; P_a+cpu leaves even that 1/M on the host.

# %% [markdown]
# ## What to try
#
# Set `MESHES = ((1, 4), (4, 1))` and compare stage 0 on both: DDP on 1 × 4 replicates the
# whole model on every rank, 4 × 1 splits it, so "DDP" there holds about Ψ/4. In the
# step-through, record stage 0 (`mesh_demo.record_block(stage=0)`): the column's collectives
# become one all-reduce per bucket at the end of backward, the row's stay where they were. Then
# do exercise 15: the column- and row-parallel layers, forward and backward, yourself.
