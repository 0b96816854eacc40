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
# # 00 · Communication: the four collectives and the ring
#
# Every ZeRO stage is built from four collectives, all in `minizero/comm.py`:
#
# | collective | before (rank r holds) | after (every rank holds) | bytes one rank sends in a ring |
# |---|---|---|---|
# | all-reduce | a tensor $x_r$ of S bytes | $\sum_r x_r$ | $2\frac{N-1}{N}S$ |
# | reduce-scatter | $x_r$ of S bytes | rank r: the sum of chunk r only (S/N) | $\frac{N-1}{N}S$ |
# | all-gather | a chunk of S/N bytes | all N chunks (S) | $\frac{N-1}{N}S$ |
# | broadcast | rank `src`: a tensor | the same tensor | $\frac{N-1}{N}S$ (pipelined) |
#
# An all-reduce *is* a reduce-scatter followed by an all-gather, which is why it costs twice as
# much. These are the numbers behind the ZeRO paper's claim that stages 1 and 2 cost no more
# communication than DDP (2Ψ) and stage 3 costs 1.5× (3Ψ).

# %% [markdown]
# **Exercise 01**: [`exercises/ex01_ring_allreduce.py`](../exercises/ex01_ring_allreduce.py), graded
# with `pytest exercises -k ex01`: build the ring all-reduce from send/recv yourself.

# %% tags=["parameters"]
from minizero.lab import demo
import plots                                  # notebooks/plots.py: the figures

NUMEL = 1_000_000                    # fp32 elements per collective: 4 MB
WORLD_SIZES = (2, 3, 4)
BACKEND, _ = demo.backend_and_world_sizes()   # gloo on CPU; NCCL with 2 or more GPUs

# %%
results = demo.measure_collectives(WORLD_SIZES, numel=NUMEL, backend=BACKEND)   # one launch per N

# %% [markdown]
# ## What each collective does
#
# On 4 ranks, rank r starts with `10 r + [0, 1, 2, 3]`. Sums use `op="sum"`; reduce-scatter hands
# rank r the sum of element r; all-gather collects element 0 of every rank; broadcast copies rank
# 0's.

# %%
shown = results[max(results)]["shown_all"]
for kind in ("input", "all_reduce", "reduce_scatter", "all_gather", "broadcast"):
    print(f"{kind:>15}: " + " | ".join(f"rank {r}: {s[kind]}" for r, s in enumerate(shown)))

# %% [markdown]
# ## The ring all-reduce, from point-to-point messages
#
# `minizero.ring.ring_all_reduce` cuts the tensor into N chunks and passes chunks around a ring.
# In N-1 steps of reduce-scatter every rank adds the chunk its left neighbour sends into its own
# copy; after them rank r owns the complete sum of one chunk. N-1 steps of all-gather then pass the
# finished chunks around. Each rank sends 2(N-1) chunks of S/N bytes: $2\frac{N-1}{N}S$, almost
# independent of N. Here is the function, read from `minizero/ring.py` now (marked: the two
# loops' exchanges, the add of phase 1 and the copy of phase 2):

# %%
from minizero import ring
from minizero.lab import source

source.show(ring.ring_all_reduce, mark=("exchange((", "+= incoming", ".copy_(incoming)"))

# %% [markdown]
# It must give exactly what the library's all-reduce gives:

# %%
for n, res in results.items():
    print(f"N = {n}: max |ring_all_reduce - all_reduce| = {res['ring_max_abs_diff']:.2e}")
    assert res["ring_max_abs_diff"] < 1e-4

# %% [markdown]
# ### The ring, exchange by exchange
#
# `minizero.lab.stepthrough.ring` runs `minizero.ring.ring_all_reduce` on N processes and
# watches its point-to-point exchanges: before each one, every rank's padded buffer and the chunk it
# sends to its right neighbour. Rank r starts with 10 r + [1, 2, 3, 4, 5]: 5 elements in N chunks of
# ⌈5/N⌉, padded. In the first N-1 exchanges the received chunk is *added*; after them rank r holds
# the complete sum of chunk r+1. In the last N-1 it *replaces* the local chunk, and the finished
# sums travel once around the ring.

# %%
from minizero.lab import stepthrough

ring = stepthrough.ring(3)                     # one launch, 3 ranks
stepthrough.check_ring(ring)                   # each exchange adds (or copies) the chunk sent
print(plots.ring_table(ring))

# %% [markdown]
# Green: the chunk the last exchange wrote; orange frame: the chunk each rank sends next. Press play
# or drag the slider over the 2(N-1) exchanges; the menu runs the ring on another N. Below each
# state: `ring_all_reduce` with the line that runs the next exchange marked (phase 1's loop for the
# first N-1, phase 2's after), recorded from the call stack of each exchange.

# %%
plots.ring_widget(ring)

# %% [markdown]
# ## Bytes moved, measured vs formula
#
# `comm.tally()` counts, per rank and per kind of collective, the bytes a bandwidth-optimal ring
# sends. For the four library collectives that is the formula applied to each call's tensor; for
# `ring_all_reduce` it is what the teaching ring really handed to `send` (chunks of ⌈S/N⌉ elements).

# %%
FORMULA = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1,
           "ring_all_reduce": 2}
for n, res in results.items():
    for kind, factor in FORMULA.items():
        formula = factor * (n - 1) / n * res["full_bytes"]
        sent = res["sent"][kind]
        print(f"N = {n} {kind:>15}: sent {sent / 1e6:6.3f} MB, formula {formula / 1e6:6.3f} MB, "
              f"{res['seconds'][kind] * 1e3:6.1f} ms")
        assert formula - 1e-6 <= sent <= formula + 2 * n * 4 * (n - 1)   # ring pads to N chunks
plots.collective_bytes(results);

# %% [markdown]
# The time column is a rough guide only: gloo on a laptop's cores is not a network. What carries
# over to real clusters is the byte count: per-rank traffic of a ring collective barely depends on
# N. One more reason: gloo's own reduce-scatter is slower than its all-reduce, and its all-gather
# slower than N broadcasts, so on gloo `minizero.comm` runs them that way (`[Note: collectives on
# gloo]` in `minizero/comm.py`; `python -m minizero.bench --collectives` times both). The tally
# still counts the ring's bytes: what the algorithm needs, and what NCCL sends.

# %% [markdown]
# ## What to try
#
# In the ring widget, switch N and count the exchanges: 2(N-1), each moving one chunk of ⌈S/N⌉
# elements, so a rank sends 2(N-1)/N·S whatever N. Find the exchange after which rank r first holds
# a complete sum (the end of the reduce-scatter half) and check it is chunk r+1. In the byte table,
# set `NUMEL` to a number no N divides and see the ring's padding in the sent bytes. Then do
# exercise 1: build the ring from send and recv yourself.
