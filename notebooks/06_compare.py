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
# # 06 · All stages side by side
#
# The same small GPT under DDP and ZeRO stages 1-3, measured at every world size (one launch per N
# runs all four stages), next to the paper's formulas; then the estimator for models of any size.
#
# | | device bytes per rank | communication per step |
# |---|---|---|
# | DDP | $(b_p + b_g + K)\Psi$ | $2\Psi$ |
# | stage 1 | $(b_p + b_g)\Psi + K\Psi/N$ | $2\Psi$ |
# | stage 2 | $b_p\Psi + (b_g + K)\Psi/N$ | $2\Psi$ |
# | stage 3 | $(b_p + b_g + K)\Psi/N$ | $3\Psi$ |
#
# **Exercise 12**: [`exercises/ex12_predict_and_plan.py`](../exercises/ex12_predict_and_plan.py),
# graded with `pytest exercises -k ex12`: predict model states and bytes per step before running,
# then plan stage, offload, checkpointing and micro-batch under a memory budget.

# %% tags=["parameters"]
from minizero.lab import demo
import plots                                  # notebooks/plots.py: the figures

MODEL, STEPS = "default", 10     # the small GPT, ~0.2 M parameters; "tiny": a few thousand
DTYPE = "fp32"     # or "bf16": the paper's 2 + 2 + 12 bytes per parameter (looser reference check)
BACKEND, WORLD_SIZES = demo.backend_and_world_sizes()   # gloo on CPU; NCCL with 2 or more GPUs
BENCH_SIZES, BENCH_REPEATS = ("default", "1M"), 3     # the bench below: models, repeats
PEERS = ("torch", "deepspeed")     # PyTorch's DDP / ZeRO / FSDP2, and DeepSpeed when installed

# %%
from minizero.lab.train import TrainConfig
variants = {s: TrainConfig(stage=s, dtype=DTYPE, steps=STEPS, model=MODEL, batch_size=24)
            for s in range(4)}
stages = demo.measure(variants, WORLD_SIZES, BACKEND)       # {stage: {N: record}}
for s, runs in stages.items():
    demo.check(runs)
print("every stage at every N matches the reference and the formulas")

# %% [markdown]
# ## Measured: memory, communication, time
#
# Left: device model-state bytes per rank (dots: measured on rank 0; lines: formula). Middle: bytes
# one rank sent in the last step (tally) against $2\Psi$ / $3\Psi$ × (N-1)/N. Right: the time of
# every step (dots) and their median (bars). On CPU processes sharing two cores the dots spread
# wider than most differences between bars: they say more about the machine than about the method.

# %%
plots.compare_measured(stages);

# %% [markdown]
# ## Against PyTorch and DeepSpeed
#
# `minizero.bench` trains the same GPT with minizero and with each stage's peer in one process
# group: PyTorch's DDP, `ZeroRedundancyOptimizer` and FSDP2 (one `fully_shard` per block, as
# minizero's units), and DeepSpeed's stages 0-3 and optimizer offload when it is installed (`pip
# install -e ".[peers]"`). Runs alternate (minizero, peers, then the reverse), a step counts at its
# slowest rank, and the ratio compares medians: below 1, minizero is faster. Every pair must end at
# the same parameters. Here two small sizes; `python -m minizero.bench --sizes 1M,8M,50M` measures
# the sizes where real models live.

# %%
from minizero.lab import bench
from minizero.lab.figures import bench_ratios
report = bench.compare((2,), sizes=BENCH_SIZES, steps=STEPS, repeats=BENCH_REPEATS, peers=PEERS,
                       meter=False)
print(bench.format_table(report))
assert all(p["max_param_diff"] < 1e-5 for p in report["pairs"]), "a peer ended elsewhere"
bench_ratios(report);

# %% [markdown]
# ## Move a run to fewer ranks
#
# A checkpoint holds each rank's partition of the masters and of Adam's moments. The flat layout is
# deterministic, so `engine.load` cuts them again for another N (or another stage): the run
# continues as if nothing happened. Restarting from the weights alone (`python -m
# minizero.consolidate`, a fresh optimizer) is what a checkpoint without resharding offers: Adam's
# moments start from zero, and the loss jumps.

# %%
import tempfile
from minizero.lab.reference import tolerance
FROM, TO = WORLD_SIZES[-1], max(WORLD_SIZES[-1] // 2, 1)
moved = demo.move_run(FROM, TO, STEPS, tempfile.mkdtemp(), MODEL, BACKEND)
assert moved["resumed_diff"] <= tolerance("fp32") < moved["fresh_diff"], moved
print(f"N = {FROM} -> {TO} after {moved['half']} steps: max |param - uninterrupted| "
      f"{moved['resumed_diff']:.1e} resharded, {moved['fresh_diff']:.1e} with a fresh optimizer")
plots.moved_run(moved);

# %% [markdown]
# ## What fits: the estimator
#
# Since every formula is linear in Ψ, the largest model whose model states fit a per-rank budget is
# budget / (bytes per parameter). With 80 GB per GPU (activations not counted): DDP stops at 5 B
# parameters whatever N, stage 3 grows linearly with N.

# %%
from minizero.memory import estimate
BUDGET = 80e9
for n in (1, 8, 64, 1024):
    fits = {s: BUDGET / estimate(1, n, s) for s in range(4)}        # bf16 + Adam: 2 + 2 + 12
    print(f"N = {n:>4}: " + ", ".join(f"{plots.STAGE_NAMES[s]} {psi / 1e9:7.1f} B"
                                     for s, psi in fits.items()))
plots.largest_model(BUDGET, "bf16");

# %% [markdown]
# ## Try it
#
# Pick a model size, a world size and a dtype: the bars are `minizero.memory.estimate_breakdown` per
# stage (the paper's example: 7.5 B parameters on N = 64 needs 120 GB per GPU under DDP, 1.9 GB
# under stage 3), the right panel `minizero.memory.comm_volume`.

# %%
from ipywidgets import Dropdown, FloatLogSlider, SelectionSlider, interact
interact(plots.estimator_view,
         world_size=SelectionSlider(options=[2 ** i for i in range(11)], value=64, description="N"),
         params_billion=FloatLogSlider(value=7.5, base=10, min=-1, max=3, step=0.05,
                                       description="Ψ (B)"),
         dtype=Dropdown(options=["bf16", "fp32"], value="bf16", description="dtype"),
         budget_gb=Dropdown(options=[16, 24, 40, 80], value=80, description="budget GB"));

# %% [markdown]
# ## Coming from DeepSpeed, FairScale or FSDP?
#
# Each term of their documentation next to the minizero code that implements the same idea (the line
# numbers are read from the code as it is now; the same table is `docs/concepts.md`).

# %%
from IPython.display import Markdown
from minizero.lab.concepts import to_markdown
Markdown(to_markdown(link_prefix="../").split("\n", 5)[5])   # the table, without the page's header

# %% [markdown]
# ## What to try
#
# In the estimator, find the smallest N at which a 7.5 B model fits 16 GB per GPU under each stage,
# and how much bf16 saves over fp32. Move the run above to another N (`FROM`, `TO`) or to stage 3
# and check the resumed run still matches the uninterrupted one. Set `MODEL = "tiny"` in the first
# code cell to measure a model of a few thousand parameters: the memory lines should still sit on
# the formulas.
