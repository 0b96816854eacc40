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
# independent of N. It must give exactly what the library's all-reduce gives:

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
# Here is the function, read from `minizero/ring.py` now. Marked: the lines that ran the exchanges
# above, recorded from the call stack of each one (phase 1's loop, then phase 2's); the line after
# each adds the received chunk (phase 1) or copies it (phase 2).

# %%
from minizero.lab import source

source.show(*[(where["file"], where["line"]) for where in ring["sources"]])

# %% [markdown]
# Green: the chunk the last exchange wrote; orange frame: the chunk each rank sends next. Press play
# or drag the slider over the 2(N-1) exchanges; the menu runs the ring on another N. Below each
# state: `ring_all_reduce` with the line that runs the next exchange marked (phase 1's loop for the
# first N-1, phase 2's after), recorded from the call stack of each exchange.

# %%
plots.ring_widget(ring)

# %% [markdown]
# ## Bytes moved: modelled and measured
#
# Two counts, kept apart. `comm.tally()` is the **model**: for each call, the bytes a
# bandwidth-optimal ring sends for that collective (the table at the top applied to the call's
# tensor, so it equals the formula by construction; for `ring_all_reduce` it counts the chunks the
# teaching ring really hands to `send`). That is the papers' unit and what NCCL sends.
# `minizero.memory.wire` **measures** what this rank put on the wire: Linux counts, per thread, the
# bytes written to sockets (`/proc/self/task/<tid>/io`), and gloo writes from threads of its own,
# read as each collective is issued and as it completes (the event stream). Each collective below
# runs alone, so each row is exact, headers included.

# %%
FORMULA = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1,
           "ring_all_reduce": 2}
for n, res in results.items():
    for kind, factor in FORMULA.items():
        formula = factor * (n - 1) / n * res["full_bytes"]
        modelled = res["sent"][kind]
        assert formula - 1e-6 <= modelled <= formula + 2 * n * 4 * (n - 1)   # ring pads to N chunks
        measured = "n/a" if res["wire"] is None else f"{res['wire'][kind] / 1e6:6.3f} MB"
        ratio = "" if res["wire"] is None else f"{res['wire'][kind] / modelled:5.2f}"
        print(f"N = {n} {kind:>15}: modelled {modelled / 1e6:6.3f} MB, measured {measured} "
              f"{ratio}, {res['seconds'][kind] * 1e3:6.1f} ms")
    if res["wire"] is None:
        print(f"    measured: n/a ({res['wire_unavailable']})")
    else:
        print(f"    broadcast from rank 0, measured on ranks 0..{n - 1}: "
              + ", ".join(f"{w['broadcast'] / 1e6:.3f}" for w in res["wire_all"]) + " MB")
plots.collective_bytes(results);

# %% [markdown]
# Where measured and modelled differ, and why (`[Note: collectives on gloo]` in
# `minizero/comm.py`; `python -m minizero.bench --collectives` times both ways):
#
# - **all-reduce**: a ring, as modelled (ratio 1.00).
# - **reduce-scatter**: gloo's own reduce-scatter is slower than its all-reduce, so on gloo
#   `comm.reduce_scatter` runs an all-reduce and keeps its part: **twice** the ring's bytes.
# - **all-gather**: N broadcasts, one from each rank's piece: the ring's bytes in all.
# - **broadcast**: gloo sends from the root down a tree, the whole tensor to each child: rank 0
#   sends S at N = 2 and 2S at N = 3 and 4 (there rank 1 forwards S once more), the others
#   nothing. The ring books (N-1)/N·S on every rank; summed over the ranks the two agree.
# - **headers**: every message carries a few dozen bytes; a few hundred bytes per call here.
#
# NCCL's collectives are rings: there the model is what is sent. `python -m minizero.run` and
# docs/performance.md show both figures for whole training steps, stage by stage. The time column
# is a rough guide only: gloo between processes on one machine's cores is not a network.

# %% [markdown]
# ## What to try
#
# In the ring widget, switch N and count the exchanges: 2(N-1), each moving one chunk of ⌈S/N⌉
# elements, so a rank sends 2(N-1)/N·S whatever N. Find the exchange after which rank r first holds
# a complete sum (the end of the reduce-scatter half) and check it is chunk r+1. In the byte table,
# set `NUMEL` to a number no N divides and see the ring's padding in the sent bytes. Then do
# exercise 1: build the ring from send and recv yourself.
