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
# # 08 · Beyond the paper: a network model that makes overlap visible
#
# On one machine the ranks talk over loopback, so communication is almost free next to compute, and what
# the later ZeRO papers are about cannot be seen: whether DDP's bucketed all-reduce really hides behind
# backward, what stage 3's prefetch buys, what stage 3's 3Ψ costs next to 2Ψ. This notebook turns on
# minizero's **network model** and measures exactly that.

# %%
import os
import network_plots                              # notebooks/network_plots.py: this notebook's figures
from minizero.lab import demo, network_runs
from minizero.lab.train import TrainConfig

SMALL = os.environ.get("MINIZERO_SMALL") == "1"     # CI: the tiny model
MODEL = "tiny" if SMALL else "default"
BASE = TrainConfig(stage=0, world_size=2, steps=4, batch_size=8, model=MODEL, backend="gloo",
                   bucket_size=network_runs.BASE.bucket_size if not SMALL else 400)
print(f"model {MODEL!r}, N = {BASE.world_size}, {BASE.steps} steps per run")

# %% [markdown]
# ## The model, and what it leaves out
#
# `minizero/network.py` describes a cluster: nodes of `ranks_per_node` consecutive ranks, a bandwidth β
# and a latency α per hop between nodes (and, optionally, inside a node: unlimited by default). Turn it on
# with `comm.set_network("1gbps,10us,ranks_per_node=2")`, `MINIZERO_NETWORK=...` or `python -m
# minizero.run --network ...`. Every collective then still runs for real over gloo (its values stay
# exact), but its handle's `wait()` returns no earlier than a ring on that network would have finished:
#
# $$t = \text{hops} \cdot \alpha + \frac{\text{bytes one rank sends}}{\beta}, \qquad
# \text{all-reduce over } n: 2(n-1) \text{ hops}, \; 2\frac{n-1}{n} S \text{ bytes}$$
#
# with the inter-node α, β as soon as the ring crosses a node boundary (the slowest link sets the pace of
# a ring). A rank's link is one resource: collectives queue on it one after another, so an asynchronous
# all-reduce issued from a backward hook runs *while autograd computes*, and a synchronous one blocks.
#
# **Left out**, so real clusters do worse: ranks of a node sharing its NICs (contention), protocol and
# message-size effects (NCCL's trees), the CPU time of the real gloo collective, clock skew between ranks.

# %%
from minizero import comm
from minizero.network import parse_network
net = parse_network("1gbps,10us,ranks_per_node=2")
print(repr(net))                                      # bytes/s and seconds
for n in (2, 4, 8, 64):
    sent = comm.ring_bytes("all_reduce", 100e6, n)          # a 100 MB gradient all-reduce
    print(f"N = {n:>2}: {sent / 1e6:6.1f} MB sent per rank, "
          f"{net.time('all_reduce', sent, n, inter_node=True) * 1e3:7.1f} ms at 1 Gb/s across nodes")

# %% [markdown]
# ## Overlap made visible: DDP with and without it
#
# Bandwidth is picked relative to this machine (`minizero/lab/network_runs.py`): one launch first trains
# DDP with no network to measure a step's compute time T, then models the bandwidth at which DDP's
# all-reduce takes ρ·T. At ρ = 1 communication is as long as compute. `wrap(model, 0, overlap=False)`
# is DDP that launches every bucket after backward instead of from the autograd hooks.
#
# The same launch also runs stage 3 with and without prefetch and the bandwidth sweep of the next
# sections (one launch, about 20 short runs).

# %%
out = network_runs.measure(network_runs.overlap_runs(1.0) + network_runs.sweep_runs(), BASE)
runs = network_runs.by_label(out)
print(f"compute T = {out['compute_s'] * 1e3:.1f} ms per step; DDP all-reduces {out['allreduce_bytes'] / 1e3:.0f} kB")
for label in ("DDP", "DDP, no overlap", "stage 3", "stage 3, no prefetch"):
    r = runs[label]
    print(f"{label:22} {r['network']:32} step {r['step_time_s'] * 1e3:6.1f} ms (fastest of {BASE.steps - 1})")
network_plots.step_times(out, ["DDP", "DDP, no overlap"]);

# %% [markdown]
# The fastest step of each run (the CPU is shared: other work slows steps at random, never speeds them
# up), as recorded: the orange bars are the modelled link busy, the blue ticks the blocks' compute events. With overlap, the first buckets go out while backward still computes the earlier layers; without
# it, the link idles through backward and the step waits for all of it afterwards.

# %%
network_plots.timelines(out, ["DDP", "DDP, no overlap"]);

# %% [markdown]
# ## Prefetch in stage 3
#
# Stage 3 all-gathers each unit before its forward and again before its backward. With prefetch
# (`wrap(..., prefetch=True)`, the default) the next unit's all-gather is issued while the current unit
# computes; without it every gather waits in front of its unit.

# %%
network_plots.step_times(out, ["stage 3", "stage 3, no prefetch"]);
network_plots.timelines(out, ["stage 3", "stage 3, no prefetch"]);

# %% [markdown]
# ## Stages 0-3 as bandwidth falls
#
# The same ratios for every stage: ρ = 0.25, 1, 4 (the bandwidth falls by 16×). Stages 0-2 send 2Ψ per
# step, stage 3 3Ψ; stages 1 and 2 also move their all-gather *after* the step, where nothing is left to
# hide it behind. The dashed lines are the same stage with no network.

# %%
network_plots.bandwidth_sweep(out);

# %% [markdown]
# Where the bytes go: every collective of stages 0-3 spans all N ranks, so as soon as there is more than one
# node, every byte crosses nodes (`comm.tally()["inter_node"]`). Hierarchical designs exist to change
# that split.

# %%
for stage in range(4):
    sent = runs[f"stage {stage}, ratio 1.0"]["comm"]
    print(f"stage {stage}: {sent['total'] / 1e3:7.1f} kB per step, {sent['intra_node'] / 1e3:6.1f} kB inside "
          f"nodes, {sent['inter_node'] / 1e3:7.1f} kB across")
demo.export("network_8", {"network": out});       # for tests/test_notebooks.py

# %% [markdown]
# ## Hierarchical sharding: shard within a group, replicate across groups (HSDP, MiCS)
#
# ZeRO shards over all N ranks, so every collective of every step spans every rank, across the
# slowest links of the cluster. FSDP2's HSDP and DeepSpeed's MiCS shard within a *group* of S ranks
# (a node, say) and keep N/S replicas of it: `minizero.wrap(model, stage, opt, shard_group_size=S)`
# for stages 1-3 (`--shard-group-size S`). Per rank, S replaces N in every sharded term:
#
# | stage | per rank, ZeRO (S = N) | per rank, groups of S |
# |---|---|---|
# | 1 | $2Ψ + 2Ψ + KΨ/N$ | $2Ψ + 2Ψ + KΨ/S$ |
# | 2 | $2Ψ + (2 + K)Ψ/N$ | $2Ψ + (2 + K)Ψ/S$ |
# | 3 | $(2 + 2 + K)Ψ/N$ | $(2 + 2 + K)Ψ/S$ |
#
# Gradients are reduce-scattered within the group, $\frac{S-1}{S}Ψ$, then each rank's partition
# is all-reduced across the N/S groups, $2\frac{N/S-1}{N/S}\cdot\frac{Ψ}{S}$; parameters are
# all-gathered within the group. The total is unchanged (for stages 1-2, $2\frac{N-1}{N}Ψ$ either
# way): what changes is that only the small all-reduce leaves the group.
# (`[Note: hierarchical sharding]` in `minizero/engine.py`.)

# %%
import os
import minizero
from minizero.lab.train import TrainConfig, train_several
from minizero.lab.report import theory
from minizero.memory import (comm_volume_by_kind, comm_volume_by_node, group_ranks,
                             secondary_partition_bytes, step_collectives, within_padding)

SMALL = os.environ.get("MINIZERO_SMALL") == "1"
N, RANKS_PER_NODE = 4, 2
base = dict(stage=3, world_size=N, steps=2, batch_size=8, model="tiny" if SMALL else "default")
hsdp_cfgs = {f"S = {s}": TrainConfig(**base, shard_group_size=s) for s in (1, 2, 4)}
hsdp_cfgs["hpZ, R = 2"] = TrainConfig(**base, hpz_group_size=RANKS_PER_NODE)
per_rank = minizero.launch(train_several, N, list(hsdp_cfgs.values()))
hsdp_runs = {name: [r[i] for r in per_rank] for i, name in enumerate(hsdp_cfgs)}

print(f"stage 3, N = {N}, rank 0, kB          params   grads   optim   (formula: params grads optim)")
for name, cfg in hsdp_cfgs.items():
    res = hsdp_runs[name][0]
    th = theory(cfg, res["num_params"], res["num_frozen"])
    m = res["memory"]
    print(f"{name:>10}  measured {m['params']/1e3:8.1f} {m['grads']/1e3:7.1f} {m['optimizer']/1e3:7.1f}"
          f"   formula {th['params']/1e3:7.1f} {th['grads']/1e3:7.1f} {th['optimizer']/1e3:7.1f}")
    for r in hsdp_runs[name]:
        assert all(within_padding(r["memory"][c], th[c], N) for c in ("params", "grads", "optimizer"))
print("every rank's memory equals the formula with S in place of N (up to padding)")


# %% [markdown]
# ## ZeRO++ hpZ: backward's all-gather stays in the node
#
# Stage 3 all-gathers every unit twice a step (forward and backward) and reduce-scatters once: 3Ψ,
# all of it across nodes. ZeRO++'s hpZ (`hpz_group_size=R`, R = ranks per node; DeepSpeed's
# `zero_hpz_partition_size`) keeps, after each unit's forward all-gather, a *secondary* partition:
# the 1/R of the unit this rank owns within its node. Backward rebuilds the unit from those, inside
# the node. Inter-node bytes fall from $3\frac{N-1}{N}Ψ$ to $2\frac{N-1}{N}Ψ$; the price is Ψ/R more
# parameter memory from each unit's forward to its backward (`[Note: hpZ]` in `minizero/zero3.py`).
#
# Below, each kind of collective's measured bytes (rank 0's `comm.tally()`) next to its formula, and
# the split into intra- and inter-node bytes by the group each collective ran in
# (`memory.step_collectives`: shard rows, replicate columns, hpZ rows; nodes of 2 ranks).

# %%
def split_by_node(cfg, res, rank=0):
    # measured bytes of each kind, attributed to the groups step_collectives says it ran in
    psi, frozen = res["num_params"] - res["num_frozen"], res["num_frozen"]
    options = dict(bytes_per_elem=4, frozen=frozen, shard_group_size=cfg.shard_group_size,
                   hpz_group_size=cfg.hpz_group_size)
    rows = step_collectives(psi, N, 3, **options)
    formula = comm_volume_by_kind(psi, N, 3, **options)
    out = {"intra_node": 0.0, "inter_node": 0.0}
    for row in rows:                  # a group of 1 rank sends nothing
        share = row["bytes"] / formula[row["kind"]] * res["comm_bytes_per_step"][row["kind"]] if row["bytes"] else 0
        ranks = group_ranks(row["group"], rank, N, cfg.shard_group_size, cfg.hpz_group_size)
        out["intra_node" if len({r // RANKS_PER_NODE for r in ranks}) == 1 else "inter_node"] += share
    return out, formula, comm_volume_by_node(psi, N, 3, RANKS_PER_NODE, rank=rank, **options)

bytes_table = {}
for name, cfg in hsdp_cfgs.items():
    res = hsdp_runs[name][0]
    measured, formula, by_node = split_by_node(cfg, res)
    bytes_table[name] = measured
    kinds = "  ".join(f"{k} {res['comm_bytes_per_step'][k]/1e3:.1f} ({v/1e3:.1f})" for k, v in formula.items())
    print(f"{name:>10}: {kinds}   intra {measured['intra_node']/1e3:.1f} kB, inter {measured['inter_node']/1e3:.1f} kB")
    for k, v in formula.items():
        assert within_padding(res["comm_bytes_per_step"][k], v, N, times=2)
    assert all(within_padding(measured[k], by_node[k], N, times=3) for k in by_node)
psi = hsdp_runs["S = 4"][0]["num_params"]
extra = secondary_partition_bytes(psi, RANKS_PER_NODE, param_bytes=4)
print(f"hpZ's price: Ψ/R = {extra/1e3:.1f} kB more parameters per rank between forward and backward "
      f"(rank 0's parameter peak: {hsdp_runs['hpZ, R = 2'][0]['memory']['peak_params']/1e3:.1f} kB with hpZ, "
      f"{hsdp_runs['S = 4'][0]['memory']['peak_params']/1e3:.1f} kB without)")

# %%
import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(7, 3))
names = list(bytes_table)
intra = [bytes_table[n]["intra_node"] / 1e3 for n in names]
inter = [bytes_table[n]["inter_node"] / 1e3 for n in names]
ax.bar(names, inter, label="inter-node")
ax.bar(names, intra, bottom=inter, label="intra-node")
ax.set_ylabel("kB per step, rank 0")
ax.set_title(f"stage 3, N = {N}, nodes of {RANKS_PER_NODE} ranks")
ax.legend();

# %% [markdown]
# ## One step, rank by rank: shard groups of 2 at N = 4
#
# A model small enough to read every number: `Linear(2, 3)`, tanh, `Linear(3, 2)`, Ψ = 17 parameters (none
# of N = 2, 3, 4 divides 17, so the flat buffer is padded), SGD with momentum 0.9 and lr 0.1 (the first
# step is $p - 0.1\,g$), 12 rows split over the ranks. `minizero.lab.stepthrough.record` wraps it with
# `minizero.wrap`, trains one step on N processes and records what every rank holds after each phase, read
# from the engine's own buffers. Each buffer is a grid: a row per rank, a column per element of the padded
# flat buffer (the parameter each element belongs to is named on top). Dashed lines: partition boundaries
# (partition r is rank r's); solid: bucket boundaries; grey: padding; blank: the rank does not hold that
# element; bold and framed: changed in this phase. (The recorder lets one bucket communicate at a time, so
# each collective is its own phase; minizero overlaps two.)
#
# **Shard groups of S = 2 at N = 4** (`shard_group_size=2`, `[Note: hierarchical sharding]` in
# `minizero/engine.py`). `comm.mesh(2)` cuts the 4 ranks into rows of 2 consecutive ranks, the *shard
# groups* {0, 1} and {2, 3} (`engine.shard_group`), and columns {0, 2} and {1, 3}, the *replicate groups*
# (`engine.replicate_group`): the ranks that hold the same partition. So each bucket is cut into S = 2
# partitions, not N = 4: rank r owns partition r mod 2 of its row, and ranks 0 and 2 hold the same one.
# Watch the phases in order:
#
# 1. **reduce-scatter within each shard group**, bucket by bucket during backward: rank r's partition
#    holds the average of *its group's* 6 rows, not yet the whole batch's; ranks 0 and 2 hold different
#    values of the same partition (the end of backward shows both in the gradient shard);
# 2. **all-reduce across the groups**, one per bucket at the start of `step()`: each partition is
#    averaged over its column, the N/S = 2 ranks that own it, so every owner now holds the whole batch's
#    gradient: the average over all N. It is the only collective that leaves a shard group
#    (2(N/S - 1)/(N/S) · Ψ/S elements per rank);
# 3. **the optimizer step** on each rank's partition: ranks 0 and 2 compute the same update (replicas);
# 4. **all-gather within each shard group**: every rank has every updated parameter again.
#
# `stepthrough.check` replays it: after the reduce-scatter each owner holds its group's mean, after
# the all-reduce the whole batch's gradient, and at the end every rank the one-process step. The menu
# changes the stage (stage 3: the all-gathers of each unit also stay in the group) and S (S = 4 is the
# paper's ZeRO: no all-reduce across groups; S = 1: groups of one rank, so the all-reduce across them is
# DDP's and every rank steps every parameter).

# %%
import plots                # notebooks/plots.py: the step-through's grids
from minizero.lab import demo, stepthrough

steps = stepthrough.record(stepthrough.StepConfig(stage=2, world_size=4, shard_group_size=2))      # one launch
stepthrough.check(steps)       # every phase against one process stepping all 12 rows
print(plots.step_table(steps))           # every phase: each buffer that changed, on every rank
demo.export("steps_8", {"steps": steps});   # tests/test_notebooks.py checks it again

# %% [markdown]
# Press play or drag the slider through the phases. A menu records the step again with another setting
# (one launch, about a second; each setting is kept once computed).

# %%
plots.step_widget(steps, stage=[1, 2, 3], shard_group_size=[1, 2, 4])

# %% [markdown]
# ## ZeRO++ qwZ and qgZ: send int8, keep everything else exact
#
# Stage 3 moves 3Ψ per step: forward's all-gather, backward's all-gather, the gradients' reduce-scatter.
# ZeRO++ (Wang et al. 2023) sends two of them quantized: **qwZ**, forward's all-gather of the weights
# (`quantized_weights=True`, stage 3), and **qgZ**, the gradient reduce-scatter (`quantized_gradients=True`,
# stages 2-3), as an all-to-all of int8 chunks that each rank dequantizes and averages in fp32. Backward's
# all-gather stays exact, and nothing stored (shards, fp32 masters, optimizer states) is ever quantized.
#
# Block quantization (`minizero/quantize.py`): blocks of $B$ elements, $scale = absmax/127$ (fp32),
# $q = round(x/scale) \in [-127, 127]$ (int8). The error of each element is at most $scale/2 =
# absmax/254$ of its block; $n$ elements travel as $n + 4\lceil n/B \rceil$ bytes instead of $4n$ (fp32)
# or $2n$ (bf16). Per step and rank, for fp32 stage 3:
# $\frac{N-1}{N}\,(3 \cdot 4\Psi) \to \frac{N-1}{N}\,(\Psi(1 + 4/B) + 4\Psi + \Psi(1 + 4/B))$.
# ZeRO++'s own qgZ is hierarchical (int4, an all-to-all inside the node, then across nodes); minizero's is
# the one-hop int8 form of the same idea.
#
# One launch of 3 ranks: one SGD step of a 432-parameter MLP ($B = 16$ divides every chunk, so the formula
# is exact) for each variant, and a short training run of the small GPT with and without quantization.

# %%
import os
import matplotlib.pyplot as plt
import minizero
from minizero.lab.quantized import LR, PSI, VARIANTS, quantized_experiment
from minizero.lab.train import TrainConfig
from minizero.memory import comm_volume

N, BLOCK = 3, 16
QSTEPS = 4 if os.environ.get("MINIZERO_SMALL") == "1" else 20
QRUNS = {"stage 3": {}, "stage 3 qwZ": {"quantized_weights": True}, "stage 3 qgZ": {"quantized_gradients": True},
         "stage 3 qwZ+qgZ": {"quantized_weights": True, "quantized_gradients": True}}
cfgs = [TrainConfig(stage=3, world_size=N, steps=QSTEPS, model="tiny", batch_size=12, **o) for o in QRUNS.values()]
quant = minizero.launch(quantized_experiment, N, cfgs, BLOCK, backend="gloo")[0]

print(f"{'variant':>16} {'measured B/step':>16} {'formula':>9}   by collective")
for name, (stage, options) in VARIANTS.items():
    tally = quant["one_step"][name]["tally"]
    formula = comm_volume(PSI, N, stage, bytes_per_elem=4, block=BLOCK, **options)
    assert tally["total"] == formula, (name, tally, formula)
    kinds = ", ".join(f"{k} {v:.0f}" for k, v in tally.items() if k != "total")
    print(f"{name:>16} {tally['total']:16.0f} {formula:9.0f}   {kinds}")

# %% [markdown]
# **One step's error.** With qgZ each rank's chunk of its gradient $g_r$ arrives off by at most
# $absmax/254$ of its block, so the average by at most $\max_r |g_r| / 254$ and the parameters after one
# SGD step by $lr$ times that. With qwZ, forward computes with weights within $absmax/254$ of the exact
# ones (backward uses the exact ones).

# %%
bound = LR * quant["grad_max"] / 254
for stage in (2, 3):
    plain, q = quant["one_step"][f"stage {stage}"]["state"], quant["one_step"][f"stage {stage} qgZ"]["state"]
    err = max((plain[k] - q[k]).abs().max().item() for k in plain)
    assert err <= bound * 1.001 + 1e-7
    print(f"stage {stage} qgZ: one step's max |param - unquantized| = {err:.2e} <= bound {bound:.2e}")
run = quant["one_step"]["stage 3 qwZ"]
for i, (w, seen) in enumerate(zip((quant["initial"][f"{j}.weight"] for j in (0, 2, 4)), run["forward"])):
    print(f"qwZ layer {i}: forward weights off by {(seen - w).abs().max():.2e} <= max|w|/254 = "
          f"{w.abs().max() / 254:.2e}")
print(f"loss of that step: {quant['one_step']['stage 3']['loss']:.6f} exact, {run['loss']:.6f} with qwZ")

# %%
fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.6))
for name, rec in zip(QRUNS, quant["runs"]):
    ax.plot(rec["losses"], label=name)
    bx.bar(name.replace("stage 3 ", "") or "exact", rec["comm_bytes_per_step"]["total"] / 1e3)
ax.set(xlabel="step", ylabel="loss", title=f"small GPT, stage 3, N = {N}: loss")
ax.legend()
bx.set(ylabel="kB sent per step and rank", title="bytes per step (default B = 256)")
plt.tight_layout()
finals = [rec["losses"][-1] for rec in quant["runs"]]
print("final losses:", ", ".join(f"{n} {f:.4f}" for n, f in zip(QRUNS, finals)))

# %% [markdown]
# The quantized runs follow the exact one within a few thousandths of the loss, for about half the bytes
# (fp32: 12 bytes an element per step become about 6). Every stored tensor stays exact, so the error does
# not accumulate in the weights: each step's quantization error is fresh and bounded.
#
# **Exercise.** [../exercises/ex09_block_quantize.py](../exercises/ex09_block_quantize.py): block
# quantize and dequantize, graded on the error bound and on the bytes stage 3 sends with them.

# %% [markdown]
# ## Try it
#
# The model's prediction at any bandwidth, from the runs above: each stage's compute T (no network) and
# bytes per step S give C = S / β; a step takes between max(T, C) (all communication hidden) and T + C
# (none hidden). The measurements above fall in between: DDP hides most of its all-reduce, stage 1 and 2's
# parameter all-gather after the step hides nothing.

# %%
from ipywidgets import FloatLogSlider, interact
interact(lambda mbps: network_plots.prediction(out, mbps),
         mbps=FloatLogSlider(value=out["runs"][0]["bandwidth"] * 8 / 1e6, base=10, min=-1, max=4, step=0.05,
                             description="Mb/s"));

# %% [markdown]
# **What to try**
#
# - `python -m minizero.run --stage 0 --world-size 2 --network 100mbps` and again with `--no-overlap`;
#   `--stage 3` with `--no-prefetch`.
# - A latency-bound network (`1tbps,1ms`): many small buckets now cost hops, not bytes; raise
#   `--bucket-size-mb`.
# - `ranks_per_node=2` at N = 4: stage 3's collectives still all cross nodes. Which collectives would you keep
#   inside a node?
# - The step-through with ZeRO++'s hpZ: `plots.step_widget(stepthrough.record(stepthrough.StepConfig(stage=3,
#   world_size=4, hpz_group_size=2)))`: each unit's backward all-gather now reads the "secondary partition
#   (hpZ)" kept from its forward, within pairs of ranks.
