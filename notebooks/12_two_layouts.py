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
# # 12 · Two layouts for ZeRO-3: flat buffers and per-parameter shards
#
# Stage 3 keeps 1/N of every parameter on each rank. *How* to cut is a design choice, and the
# field has made it twice:
#
# - **flat** (DeepSpeed, FairScale, PyTorch's FSDP1; minizero's `wrap(model, 3)`: `flat.py`,
#   `zero3.py`): a unit's parameters are laid end to end in one buffer, padded to a multiple of N
#   and cut into N equal pieces, wherever the cuts fall. A piece may begin in the middle of one
#   matrix and end in another. The optimizer steps a few long 1-D views of the piece.
# - **per-parameter** (PyTorch's FSDP2, `fully_shard`; minizero's `minizero.fully_shard`:
#   `minizero/pytorch/`): each parameter is cut on its own, along dim 0, into N shards of
#   chunk = ⌈d₀/N⌉ rows, the last ones padded with zero rows. Each shard is a DTensor of the
#   parameter's own shape that the user's optimizer, `clip_grad_norm_` and checkpoints take as
#   they are.
#
# Both run on minizero's comm layer: the same all-gathers and reduce-scatters, tallied and on the
# event stream alike. What a rank holds, with b bytes per element and K bytes of optimizer state
# per element (fp32 AdamW: b = 4, K = 8), Ψ_u the elements of unit u, and parameter p seen as
# d₀ rows of w_p elements, cut in chunks of c_p = ⌈d₀/N⌉ rows:
#
# | | parameters, gradients | optimizer state, rank r | padding, all ranks |
# |---|---|---|---|
# | flat | $b\sum_u \lceil \Psi_u / N \rceil$ | $K\sum_u \lceil \Psi_u / N \rceil$ | < N per unit |
# | per-parameter | $b\sum_p c_p\, w_p$ | $K\sum_p \rho_p(r)\, w_p$ | < N rows per parameter |
#
# where $\rho_p(r) = \min(c_p, \max(0, d_0 - r\,c_p))$ are the real rows of rank r's shard: the
# flat layout's optimizer state is the same on every rank, the per-parameter one's covers the
# real rows only, so it differs between ranks (AdamW adds a 4-byte step count per tensor it
# steps). This notebook measures both designs on the same model and data: one step rank by rank,
# memory against these formulas, collectives, bytes, copies and time, and what each design lets a
# user do.

# %% [markdown]
# **Exercise 17**: [`exercises/ex17_dim0_shards.py`](../exercises/ex17_dim0_shards.py), graded with
# `pytest exercises -k ex17`: a parameter's dim-0 shard with FSDP2's padding, the all-gather that
# rebuilds it and its gradient's reduce-scatter, averaged over the ranks.

# %% tags=["parameters"]
import layout_plots                 # notebooks/layout_plots.py: this notebook's figures
import plots                        # notebooks/plots.py: the step-through's grid and widget
from ipywidgets import IntSlider, interact
from minizero.lab import layout_features, layouts, source, stepthrough

N_STEP = 3                          # the step-through: the 17-parameter model on 3 ranks
MODEL, STEPS = "default", 6         # the measurements: the small GPT, ~0.2 M parameters
WORLD_SIZES = (2, 3, 4)
FEATURES_N = 2                      # what each layout lets a user do: the tiny GPT on 2 ranks

# %% [markdown]
# ## Where each layout cuts
#
# The step-through's model, `Linear(2, 3)`, tanh, `Linear(3, 2)`: Ψ = 17 in two units, l1 (its
# weight [3, 2] and bias [3]) and l2 (weight [2, 3], bias [2]). The cells are the elements each
# design stores, coloured by the rank that holds them; thick lines separate units, thin ones
# parameters. The cuts follow the implementation's own rules, read from it: `flat.padded_size`
# for a unit, `fsdp_param.padded_rows` for a parameter. Move N.

# %%
model = stepthrough.tiny_model()
UNITS = [["l1.weight", "l1.bias"], ["l2.weight", "l2.bias"]]
interact(lambda n: layout_plots.cuts(model, UNITS, n), n=IntSlider(min=2, max=6, value=N_STEP));

# %% [markdown]
# At N = 3 the flat layout pads one element (unit l2's 8 elements to 9) and cuts l1's weight
# inside its second row (rank 0's 3 elements are its first row and half the second); the
# per-parameter layout pads l2's weight by a whole row of 3 elements and its bias by one, and
# rank 2 holds no real element of l2 at all. At N = 4 rank 3 holds only
# padding of every parameter: l1 has 3 rows, 3 ranks take one each. Padding is per unit (< N
# elements) in one design, per parameter (< N rows) in the other.
#
# ## One step, rank by rank
#
# The step-through of notebooks 01-05 (`minizero/lab/stepthrough.py`), now for both layouts on the
# same model, data and SGD (lr 0.1, momentum 0.9): each Linear a unit, then the root. The flat
# recording is notebook 04's; the per-parameter one (`stepthrough_fully_shard.py`) draws each
# parameter as its own padded segment of N·chunk·row elements, rank r's shard its r-th piece, in
# the same grid. One launch each; `check` replays every phase against one process stepping the
# whole batch.

# %%
flat = stepthrough.record(stepthrough.StepConfig(stage=3, world_size=N_STEP))
per_parameter = stepthrough.record(stepthrough.StepConfig(stage=3, world_size=N_STEP,
                                                          layout="per-parameter"))
stepthrough.check(flat)
stepthrough.check(per_parameter)
print(plots.step_table(per_parameter))

# %% [markdown]
# Play or drag through the phases; the menus record the other layout or another N (one launch).
# Below each phase, the function of minizero that produced it, its line marked.

# %%
plots.step_widget(per_parameter, layout=["per-parameter", "flat"], world_size=[2, 3, 4])

# %% [markdown]
# What to look for, against the flat recording (switch the menu):
#
# - **The same collectives.** Each unit is all-gathered for its forward and freed, all-gathered
#   again for its backward (l1's a prefetch, started as l2's backward begins), its gradients
#   reduce-scattered once: two all-gathers and one reduce-scatter per unit, the 3Ψ of stage 3.
# - **What each rank holds between steps**: rows r·chunk … of every parameter (the parameter
#   shard row) instead of one contiguous slice of each unit's buffer; the zeros past d₀ show as
#   `pad`.
# - **The gradients go through a buffer laid out by rank** ("its gradients complete"): row q of
#   the reduce-scatter's buffer is rank q's rows of every gradient of the unit, side by side; the
#   reduce-scatter averages row r onto rank r. In the flat layout the bucket already is that
#   buffer.
# - **One reduce-scatter in flight.** The averaged rows reach the shards' `.grad` only when the
#   next unit's reduce-scatter starts, or when backward ends (the "finished" phases), as FSDP2
#   does; the flat stage adds each bucket's partition to the gradient shard as its collective
#   completes.
# - **Uneven optimizer state.** After the step, rank 2's momentum row has no element of l2: its
#   shards of l2 are all padding, and the optimizer keeps state for real rows only.
#
# ### The lines that did it
#
# Every line of minizero that executed during the per-parameter recording was noted by a line
# tracer (`sys.settrace`, the hook debuggers and coverage tools use; it changes nothing), so the
# marks below are the lines that ran, and the unmarked ones did not run here (HSDP's and
# `reshard_after_forward=k`'s branches). First a unit's all-gather: `Unit.gather` copies each
# parameter's padded shard into row r of one buffer `[N, Σ chunk·row]` (the copy-in:
# `copy_shard_into`), all-gathers it, and `_copy_out` copies each parameter's column out into its
# own whole tensor. Then the flat layout's `Unit.gather` (`zero3.py`) from its recording: one
# all-gather into the unit's buffer, whose views *are* the parameters; nothing to copy out.

# %%
source.show(*stepthrough.ran(per_parameter, "Unit.gather", "Unit._copy_out",
                             "ShardedParam.copy_shard_into"))

# %%
source.show(*stepthrough.ran(flat, "Unit.gather"))

# %% [markdown]
# The gradients' way back: `Reduction` lays each whole gradient out by rank into the
# reduce-scatter's buffer (`copy_grad_into`: padded to N·chunk rows with zeros), reduce-scatters
# it with `op="avg"`, and `finish`, one collective later, adds each parameter's rows to its
# shard's `.grad` (`add_grad`).

# %%
source.show(*stepthrough.ran(per_parameter, "ShardedParam.copy_grad_into", "Reduction.__init__",
                             "Reduction.finish", "ShardedParam.add_grad"))

# %% [markdown]
# ## Memory per rank, against each design's formula
#
# `minizero.lab.layouts.compare_layouts` trains the small GPT with each design on the same rows
# (AdamW, fp32, the blocks as units and the root): `wrap(model, 3)`; `fully_shard` on each block
# and on the root with `reshard_after_forward=True`, the flat design's schedule, so that only the
# layout differs; and `fully_shard` at FSDP2's default, where the root stays gathered from forward
# to backward. Each rank measures its model-state bytes (each storage once) after the last step;
# the table sets rank 0's beside the formulas above, and every rank is checked against its own.
# One launch per N.

# %%
reports = {n: layouts.compare_layouts(MODEL, n, steps=STEPS) for n in WORLD_SIZES}
for report in reports.values():
    print(layouts.format_layouts(report), end="\n\n")
for n, report in reports.items():
    for design, rec in report["designs"].items():
        for rank, (measured, formula) in enumerate(zip(rec["memory"], rec["formula"])):
            assert measured == {k: formula[k] for k in measured}, (n, design, rank)
    optimizer = {d: [m["optimizer"] for m in report["designs"][d]["memory"]]
                 for d in ("flat", "per-parameter")}
    print(f"N = {n}: optimizer state per rank (B), flat {optimizer['flat']}, "
          f"per-parameter {optimizer['per-parameter']}")
layout_plots.memory(reports);

# %% [markdown]
# Where each design pads the GPT at N = 3: the flat layout pads each unit to a multiple of 3, a
# few elements; the per-parameter layout pads every parameter whose dim 0 (64 or 256 rows here,
# the width of the model and of its MLP) is not a multiple of 3, a row or two each.

# %%
n_pad = 3 if 3 in reports else max(reports)
where = reports[n_pad]["padding"]
print(f"N = {n_pad}, flat: {[(u['unit'], u['padding']) for u in where['flat']]} elements")
padded = [p for p in where["per-parameter"] if p["padding"]]
print(f"per-parameter: {len(padded)} of {len(where['per-parameter'])} parameters padded, "
      f"{sum(p['padding'] for p in padded):,} elements in all, for example")
for p in padded[:6]:
    print(f"  {p['name']:<24} {str(p['shape']):<10} chunk {p['chunk']:>3} rows, "
          f"{p['padding_rows']} padding rows; rows per rank {p['rows']}")

# %% [markdown]
# Read the table by column. Parameters and gradients: the per-parameter layout stores
# ⌈d₀/N⌉·row of every parameter; at N = 2 and 4 every dim 0 of this GPT divides and the two
# designs store the same, at N = 3 it stores more (its padding column). The optimizer state:
# flat, the same on every rank; per-parameter, AdamW's moments over each rank's real rows, so the
# last rank, whose shards end in padding, holds less; and AdamW keeps a 4-byte step count per
# tensor it steps, one per parameter here, one per view of a unit's shard there. Both designs end
# at the same parameters (the table's last line: AdamW amplifies the two reductions' different
# summation orders to ~1e-5; the project's bar for fp32 is 1e-4).
#
# ## Collectives, bytes and time per step
#
# From the same runs: the collectives of one step (counted on the event stream), their bytes as
# the ring sends them (`comm.tally`, modelled) and as gloo sent them (`minizero/memory/wire.py`,
# measured: gloo's reduce-scatter is an all-reduce, notebook 00), the bytes copied in memory in
# one step (every aten `copy_`, counted by a `TorchDispatchMode`), and the step's time split into
# forward, backward and the optimizer step. **This is a 0.2 M-parameter model on a shared 2-core
# CPU**: read the times as orders of magnitude, not as a benchmark (`python -m minizero.bench
# --stages fully_shard` times the real sizes against torch's own `fully_shard`).

# %%
print(f"{'N':>2} {'design':<26}{'AG':>4}{'RS':>4}{'ring kB':>9}{'wire kB':>9}{'copies':>8}"
      f"{'copied kB':>10}{'forward':>9}{'backward':>9}{'step ms':>8}")
for n, report in reports.items():
    for design, d in report["designs"].items():
        wire_kb = "n/a" if d["wire_per_step"][0] is None else f"{d['wire_per_step'][0] / 1e3:.1f}"
        t = d["phase_times_s"]
        print(f"{n:>2} {design:<26}{d['collectives'].get('all_gather', 0):>4.0f}"
              f"{d['collectives'].get('reduce_scatter', 0):>4.0f}"
              f"{d['bytes_per_step']['total'] / 1e3:>9.1f}{wire_kb:>9}{d['copies']['count']:>8}"
              f"{d['copies']['bytes'] / 1e3:>10.1f}{t['forward'] * 1e3:>9.1f}"
              f"{t['backward'] * 1e3:>9.1f}{t['step'] * 1e3:>8.1f}")
layout_plots.costs(reports);

# %% [markdown]
# - **Collectives.** With the same units and schedule the two layouts issue the same collectives:
#   10 all-gathers (the root and 4 blocks, forward and backward) and 5 reduce-scatters. FSDP2's
#   default keeps the root gathered from forward to backward: one all-gather fewer. That is a
#   policy (`reshard_after_forward`), not the layout.
# - **Bytes.** The same up to padding: at N = 3 the per-parameter layout moves its padding rows
#   too. gloo's wire carries more than the ring model (its reduce-scatter runs as an all-reduce)
#   for both alike.
# - **Copies.** The per-parameter layout copies 2 to 2.5 times the flat one's bytes per step, in
#   4 to 5 times as many `copy_` calls (the small GPT at N = 2, 3, 4): every shard into the
#   all-gather's buffer and every parameter out of it (twice a step), every gradient into the
#   reduce-scatter's buffer. The flat
#   layout's parameters are views of its gathered buffer. On a GPU FSDP2 fuses these into a few
#   kernels; they cost memory bandwidth, not collectives.
# - **The optimizer step** takes about a millisecond for the flat design and tens of
#   milliseconds for the per-parameter one here: the user's AdamW steps one DTensor per parameter
#   (52 here), and every elementwise op on a DTensor passes through its dispatch; the flat design
#   steps a few long views. The next section measures the two effects apart.
#
# ## What per-parameter sharding buys, and what it costs
#
# `minizero.lab.layout_features` measures each claim on both designs, on the tiny GPT at N = 2
# (SGD, one process on the whole batch as the yardstick), in one launch; the optimizer step's
# cost on the small GPT.

# %%
found = layout_features.what_it_buys(FEATURES_N)
print(layout_features.format_features(found))

# %% [markdown]
# **What it buys**, each next to its row above:
#
# - **Frozen and trainable parameters mixed freely.** Block 0 holds two frozen weights beside
#   trainable ones (LoRA and BitFit fine-tune that way). The per-parameter layout gathers the unit
#   in one all-gather as before, and its reduce-scatter carries the trainable rows only. The flat
#   layout needs a second buffer for the frozen parameters of a unit (one flat buffer has one
#   `requires_grad`; FSDP1 refused the mix unless `use_orig_params=True`): two more all-gathers a
#   step here. And unfreezing a weight after sharding (`requires_grad_(True)`) takes effect per
#   parameter: it trains, as one process would; the flat engine decided its buffers when it was
#   built, and ignores it silently (the weight did not move).
# - **Sharded state dicts without communication.** `model.state_dict()` is DTensors over each
#   rank's own rows, named as the model's parameters: no collective, no byte on the wire, and
#   `torch.distributed.checkpoint` saves them as they are. The flat model's own parameters are
#   placeholders between steps (NaN, 4 bytes of storage); its state by name is
#   `engine.full_state_dict()`, an all-gather per unit. A flat partition cannot be a tensor of
#   the parameter's shape where it cuts inside a row (the parameters listed).
# - **`clip_grad_norm_` as written.** On the shards, torch's own function computes the global
#   norm (one DTensor all-reduce of the squares) and clips: the same norm and gradients as one
#   process. On the flat design the model's parameters carry no gradient, so the same line
#   returns 0 and clips nothing; the engine's own `clip_grad_norm=` option is what clips there.
# - **Room for optimizers that need a parameter's shape.** The optimizer steps tensors of the
#   parameters' own shapes (global shape, local rows). `torch.optim.Muon` refuses the flat views
#   (1-D); on the shards it steps, and DTensor gathers what Newton-Schulz needs by itself, with
#   many small collectives outside minizero's comm (counted above; notebook 11's designs do it
#   with fewer). Its distance from one process is bf16 Newton-Schulz rounding, as notebook 11
#   explains.
#
# **What it costs**, measured in the sections above:
#
# - **Padding per parameter**: up to N - 1 rows of every parameter instead of N - 1 elements per
#   unit (the memory table's padding column, the bytes at N = 3).
# - **A copy-in and a copy-out** around every collective (the copies column), where the flat
#   layout's parameters are views of its buffer.
# - **Uneven optimizer state**: ranks whose shards end in padding hold less (the memory table's
#   last rank at N = 3; in the step-through, rank 2 at N = 3 holds no momentum of l2).
# - **An optimizer step over many small DTensors**: the "step cost" row times AdamW over the
#   shards as DTensors, over plain tensors of the same shapes, and over plain tensors of the flat
#   design's shapes, on the small GPT: both multiply the time, the number of tensors (the flat
#   shapes against the same shapes) and DTensor's dispatch (the shards against plain tensors of
#   their shapes), each several times over here. On a GPU, where fused and foreach optimizers
#   step many tensors in a few kernels, the count matters less.

# %% [markdown]
# ## What to try
#
# In the step-through, switch the layout menu at N = 4: rank 3's shards are all padding in the
# per-parameter layout, and its momentum row stays empty. Move the slider of the first figure to
# N = 5 and count the padding of each design. Set `WORLD_SIZES = (3, 6)`: at N = 6 the GPT's 64
# rows split 11 + 11 + … + 9 and the padding grows, while the flat layout still pads a few
# elements per unit. Then do exercise 17: the dim-0 shard with its padding, the all-gather that
# rebuilds a parameter, and the reduce-scatter of its gradient.
