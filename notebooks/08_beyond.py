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
# # 08 · Beyond the paper: the network, hierarchical sharding, ZeRO++
#
# What came after the ZeRO paper, each measured on this machine's processes:
#
# 1. **A network model** (`minizero/beyond/network.py`). On one machine the ranks talk over
# loopback, so
#    communication is almost free next to compute: whether DDP's bucketed all-reduce hides behind
#    backward, what stage 3's prefetch buys, what 3Ψ costs next to 2Ψ cannot be seen. With a
#    modelled network they can: step times with and without overlap and prefetch, stages 0-3 as
#    bandwidth falls.
# 2. **Hierarchical sharding** (FSDP2's HSDP, DeepSpeed's MiCS): shard within a group of S ranks,
#    replicate across groups; memory per rank against S, bytes inside and across nodes, and one step
#    rank by rank.
# 3. **ZeRO++**: hpZ (backward's all-gather inside the node), qwZ and qgZ (int8 block quantization
#    of the all-gather and the reduce-scatter): bytes, one step's error, loss curves.
#
# **Exercise 13**: [`exercises/ex13_block_quantize.py`](../exercises/ex13_block_quantize.py), graded
# with `pytest exercises -k ex13`: ZeRO++'s int8 block quantization: within absmax/254 of every
# element, and the bytes qwZ and qgZ send with it.
#
# **Exercise 14**: [`exercises/ex14_overlap_buckets.py`](../exercises/ex14_overlap_buckets.py),
# graded with `pytest exercises -k ex14`: overlap: launch gradient buckets in order, at most k in
# flight, timed by the network model; choose the bucket size for a link from its α-β time; prefetch
# stage 3's units in the order they run, forward then backward.

# %% tags=["parameters"]
import network_plots                # notebooks/network_plots.py: this notebook's figures
from minizero.lab import network_runs
from minizero.lab.train import TrainConfig

MODEL = "default"                   # the GPT every run trains; "tiny": a few thousand parameters
BUCKET_SIZE = network_runs.BASE.bucket_size      # bytes per gradient bucket (stages 0 and 2)
QSTEPS = 20                         # training steps of each quantized run (ZeRO++ qwZ / qgZ)

# %%
BASE = TrainConfig(stage=0, world_size=2, steps=4, batch_size=8, model=MODEL, backend="gloo",
                   bucket_size=BUCKET_SIZE)
print(f"model {MODEL!r}, N = {BASE.world_size}, {BASE.steps} steps per run")

# %% [markdown]
# ## The model, and what it leaves out
#
# `minizero/beyond/network.py` describes a cluster: nodes of `ranks_per_node` consecutive ranks, a
# bandwidth β and a latency α per hop between nodes (and, optionally, inside a node: unlimited by
# default). Turn it on with `network.set_network("1gbps,10us,ranks_per_node=2")`,
# `MINIZERO_NETWORK=...` or `python -m minizero.run --network ...`. Every collective then still runs
# for real over gloo (its values stay exact), but its handle's `wait()` returns no earlier than a
# ring on that network would have finished:
#
# $$t = \text{hops} \cdot \alpha + \frac{\text{bytes one rank sends}}{\beta}, \qquad
# \text{all-reduce over } n: 2(n-1) \text{ hops}, \; 2\frac{n-1}{n} S \text{ bytes}$$
#
# with the inter-node α, β as soon as the ring crosses a node boundary (the slowest link sets the
# pace of a ring). A rank's link is one resource: collectives queue on it one after another, so an
# asynchronous all-reduce issued from a backward hook runs *while autograd computes*, and a
# synchronous one blocks.
#
# **Left out**, so real clusters do worse: ranks of a node sharing its NICs (contention), protocol
# and message-size effects (NCCL's trees), the CPU time of the real gloo collective, clock skew
# between ranks.

# %%
from minizero import comm
from minizero.beyond.network import parse_network
net = parse_network("1gbps,10us,ranks_per_node=2")
print(repr(net))                                      # bytes/s and seconds
for n in (2, 4, 8, 64):
    sent = comm.ring_bytes("all_reduce", 100e6, n)          # a 100 MB gradient all-reduce
    print(f"N = {n:>2}: {sent / 1e6:6.1f} MB sent per rank, "
          f"{net.time('all_reduce', sent, n, inter_node=True) * 1e3:7.1f} ms at 1 Gb/s "
          "across nodes")

# %% [markdown]
# ## Overlap made visible: DDP with and without it
#
# Bandwidth is picked relative to this machine (`minizero/lab/network_runs.py`): one launch first
# trains DDP with no network to measure a step's compute time T, then models the bandwidth at which
# DDP's all-reduce takes ρ·T. At ρ = 1 communication is as long as compute. `wrap(model, 0,
# overlap=False)` is DDP that launches every bucket after backward instead of from the autograd
# hooks.
#
# The same launch also runs stage 3 with and without prefetch and the bandwidth sweep of the next
# sections (one launch, about 20 short runs).

# %%
out = network_runs.measure(network_runs.overlap_runs(1.0) + network_runs.sweep_runs(), BASE)
runs = network_runs.by_label(out)
print(f"compute T = {out['compute_s'] * 1e3:.1f} ms per step; "
      f"DDP all-reduces {out['allreduce_bytes'] / 1e3:.0f} kB")
for label in ("DDP", "DDP, no overlap", "stage 3", "stage 3, no prefetch"):
    r = runs[label]
    print(f"{label:22} {r['network']:32} step {r['step_time_s'] * 1e3:6.1f} ms "
          f"(fastest of {BASE.steps - 1})")
network_plots.step_times(out, ["DDP", "DDP, no overlap"]);

# %% [markdown]
# The fastest step of each run (the CPU is shared: other work slows steps at random, never speeds
# them up), as recorded: the orange bars are the modelled link busy, the blue ticks the blocks'
# compute events. With overlap, the first buckets go out while backward still computes the earlier
# layers; without it, the link idles through backward and the step waits for all of it afterwards.

# %%
network_plots.timelines(out, ["DDP", "DDP, no overlap"]);

# %% [markdown]
# ## Prefetch in stage 3
#
# Stage 3 all-gathers each unit before its forward and again before its backward. With prefetch
# (`wrap(..., prefetch=True)`, the default) the next unit's all-gather is issued while the current
# unit computes; without it every gather waits in front of its unit.

# %%
network_plots.step_times(out, ["stage 3", "stage 3, no prefetch"]);
network_plots.timelines(out, ["stage 3", "stage 3, no prefetch"]);

# %% [markdown]
# ## Stages 0-3 as bandwidth falls
#
# The same ratios for every stage: ρ = 0.25, 1, 4 (the bandwidth falls by 16×). Stages 0-2 send 2Ψ
# per step, stage 3 3Ψ; stages 1 and 2 also move their all-gather *after* the step, where nothing is
# left to hide it behind. The dashed lines are the same stage with no network.

# %%
network_plots.bandwidth_sweep(out);

# %% [markdown]
# Where the bytes go: every collective of stages 0-3 spans all N ranks, so as soon as there is more
# than one node, every byte crosses nodes (`network.tally()["inter_node"]` in
# `minizero/beyond/network.py`). Hierarchical designs exist to change that split.

# %%
for stage in range(4):
    sent = runs[f"stage {stage}, ratio 1.0"]["comm"]
    print(f"stage {stage}: {sent['total'] / 1e3:7.1f} kB per step, "
          f"{sent['intra_node'] / 1e3:6.1f} kB inside nodes, "
          f"{sent['inter_node'] / 1e3:7.1f} kB across")

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
# (`[Note: hierarchical sharding]` in `minizero/beyond/hierarchical.py`.)

# %%
import minizero
from minizero import comm
from minizero.beyond.network import set_network
from minizero.lab.report import theory
from minizero.lab.train import train_several
from minizero.memory import (comm_volume_by_kind, comm_volume_by_node, secondary_partition_bytes,
                             within_padding)

HSDP_N, RANKS_PER_NODE = 4, 2
base = dict(stage=3, world_size=HSDP_N, steps=2, batch_size=8, model=MODEL)
hsdp_cfgs = {f"S = {s}": TrainConfig(**base, shard_group_size=s) for s in (1, 2, 4)}
hsdp_cfgs["hpZ, R = 2"] = TrainConfig(**base, hpz_group_size=RANKS_PER_NODE)
# nodes of 2 ranks, fast enough to cost nothing: the ranks' network.tally() books each collective's
# bytes as intra- or inter-node by the ranks of its group
set_network(f"1000gbps,ranks_per_node={RANKS_PER_NODE}")
per_rank = minizero.launch(train_several, HSDP_N, list(hsdp_cfgs.values()))
set_network(None)
hsdp_runs = {name: [r[i] for r in per_rank] for i, name in enumerate(hsdp_cfgs)}

print(f"stage 3, N = {HSDP_N}, rank 0, kB     params   grads   optim   "
      "(formula: params grads optim)")
for name, cfg in hsdp_cfgs.items():
    res = hsdp_runs[name][0]
    th = theory(cfg, res["num_params"], res["num_frozen"])
    m = res["memory"]
    print(f"{name:>10}  measured {m['params'] / 1e3:8.1f} {m['grads'] / 1e3:7.1f} "
          f"{m['optimizer'] / 1e3:7.1f}   formula {th['params'] / 1e3:7.1f} "
          f"{th['grads'] / 1e3:7.1f} {th['optimizer'] / 1e3:7.1f}")
    for r in hsdp_runs[name]:
        for c in ("params", "grads", "optimizer"):
            assert within_padding(r["memory"][c], th[c], HSDP_N), (name, r["rank"], c)
print("every rank's memory equals the formula with S in place of N (up to padding)")


# %% [markdown]
# ## ZeRO++ hpZ: backward's all-gather stays in the node
#
# Stage 3 all-gathers every unit twice a step (forward and backward) and reduce-scatters once: 3Ψ,
# all of it across nodes. ZeRO++'s hpZ (`hpz_group_size=R`, R = ranks per node; DeepSpeed's
# `zero_hpz_partition_size`) keeps, after each unit's forward all-gather, a *secondary* partition:
# the 1/R of the unit this rank owns within its node. Backward rebuilds the unit from those, inside
# the node. Inter-node bytes fall from $3\frac{N-1}{N}Ψ$ to $2\frac{N-1}{N}Ψ$; the price is Ψ/R more
# parameter memory from each unit's forward to its backward (`[Note: hpZ]` in
# `minizero/beyond/hpz.py`).
#
# Below, each kind of collective's measured bytes (rank 0's `comm.tally()`) next to its formula
# (`memory.comm_volume_by_kind`), and the bytes that stayed inside a node and those that crossed
# nodes, as the tally measured them (a collective crosses nodes when its group's ranks sit on more
# than one node), next to `memory.comm_volume_by_node`.

# %%
bytes_table = {}
for name, cfg in hsdp_cfgs.items():
    res = hsdp_runs[name][0]
    sent = res["comm_bytes_per_step"]                    # rank 0's tally of the last step
    options = dict(bytes_per_elem=4, frozen=res["num_frozen"],
                   shard_group_size=cfg.shard_group_size, hpz_group_size=cfg.hpz_group_size)
    psi = res["num_params"] - res["num_frozen"]
    by_kind = comm_volume_by_kind(psi, HSDP_N, 3, **options)
    by_node = comm_volume_by_node(psi, HSDP_N, 3, RANKS_PER_NODE, rank=0, **options)
    bytes_table[name] = {k: sent[k] for k in by_node}
    kinds = "  ".join(f"{k} {sent[k] / 1e3:.1f} ({v / 1e3:.1f})" for k, v in by_kind.items())
    print(f"{name:>10}: {kinds}   intra {sent['intra_node'] / 1e3:.1f} "
          f"({by_node['intra_node'] / 1e3:.1f}) kB, inter {sent['inter_node'] / 1e3:.1f} "
          f"({by_node['inter_node'] / 1e3:.1f}) kB")
    for k, v in by_kind.items():
        assert within_padding(sent[k], v, HSDP_N, times=2), (name, k)
    for k, v in by_node.items():
        assert within_padding(sent[k], v, HSDP_N, times=3), (name, k)
print("(formula in brackets)")
psi = hsdp_runs["S = 4"][0]["num_params"]
extra = secondary_partition_bytes(psi, RANKS_PER_NODE, param_bytes=4)
peak = {name: hsdp_runs[name][0]["memory"]["peak_params"] / 1e3 for name in ("hpZ, R = 2", "S = 4")}
print(f"hpZ's price: Ψ/R = {extra / 1e3:.1f} kB more parameters per rank between forward and "
      f"backward (rank 0's parameter peak: {peak['hpZ, R = 2']:.1f} kB with hpZ, "
      f"{peak['S = 4']:.1f} kB without)")

# %%
import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(7, 3))
names = list(bytes_table)
intra = [bytes_table[n]["intra_node"] / 1e3 for n in names]
inter = [bytes_table[n]["inter_node"] / 1e3 for n in names]
ax.bar(names, inter, label="inter-node")
ax.bar(names, intra, bottom=inter, label="intra-node")
ax.set_ylabel("kB per step, rank 0")
ax.set_title(f"stage 3, N = {HSDP_N}, nodes of {RANKS_PER_NODE} ranks (comm.tally)")
ax.legend();

# %% [markdown]
# ## One step, rank by rank: shard groups of 2 at N = 4
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
# **Shard groups of S = 2 at N = 4** (`shard_group_size=2`, `[Note: hierarchical sharding]` in
# `minizero/beyond/hierarchical.py`). `mesh.mesh(2)` (`minizero/beyond/mesh.py`) cuts the 4 ranks
# into rows of 2 consecutive ranks, the *shard groups* {0, 1} and {2, 3} (`engine.shard_group`), and
# columns {0, 2} and {1, 3}, the *replicate groups* (`engine.replicate_group`): the ranks that hold
# the same partition. So each bucket is cut into S = 2 partitions, not N = 4: rank r owns partition
# r mod 2 of its row, and ranks 0 and 2 hold the same one. Watch the phases in order:
#
# 1. **reduce-scatter within each shard group**, bucket by bucket during backward: rank r's
#    partition holds the average of *its group's* 6 rows, not yet the whole batch's; ranks 0 and 2
#    hold different values of the same partition (the end of backward shows both in the gradient
#    shard);
# 2. **all-reduce across the groups**, one per bucket at the start of `step()`: each partition is
#    averaged over its column, the N/S = 2 ranks that own it, so every owner now holds the whole
#    batch's gradient: the average over all N. It is the only collective that leaves a shard group
#    (2(N/S - 1)/(N/S) · Ψ/S elements per rank);
# 3. **the optimizer step** on each rank's partition: ranks 0 and 2 compute the same update
#    (replicas);
# 4. **all-gather within each shard group**: every rank has every updated parameter again.
#
# `stepthrough.check` replays it: after the reduce-scatter each owner holds its group's mean, after
# the all-reduce the whole batch's gradient, and at the end every rank the one-process step. The
# menu changes the stage (stage 3: the all-gathers of each unit also stay in the group) and S (S = 4
# is the paper's ZeRO: no all-reduce across groups; S = 1: groups of one rank, so the all-reduce
# across them is DDP's and every rank steps every parameter).

# %%
import plots                # notebooks/plots.py: the step-through's grids
from minizero.lab import stepthrough

steps = stepthrough.record(stepthrough.StepConfig(stage=2, world_size=4, shard_group_size=2))
stepthrough.check(steps)       # every phase against one process stepping all 12 rows
print(plots.step_table(steps))           # every phase: each buffer that changed, on every rank

# %% [markdown]
# Press play or drag the slider through the phases. A menu records the step again with another
# setting (one launch, about a second; each setting is kept once computed).

# %%
plots.step_widget(steps, stage=[1, 2, 3], shard_group_size=[1, 2, 4])

# %% [markdown]
# ## ZeRO++ qwZ and qgZ: send int8, keep everything else exact
#
# Stage 3 moves 3Ψ per step: forward's all-gather, backward's all-gather, the gradients'
# reduce-scatter. ZeRO++ (Wang et al. 2023) sends two of them quantized: **qwZ**, forward's
# all-gather of the weights (`quantized_weights=True`, stage 3), and **qgZ**, the gradient
# reduce-scatter (`quantized_gradients=True`, stages 2-3), as an all-to-all of int8 chunks that each
# rank dequantizes and averages in fp32. Backward's all-gather stays exact, and nothing stored
# (shards, fp32 masters, optimizer states) is ever quantized.
#
# Block quantization (`minizero/beyond/quantize.py`): blocks of $B$ elements, $scale = absmax/127$
# (fp32), $q = round(x/scale) \in [-127, 127]$ (int8). The error of each element is at most $scale/2
# = absmax/254$ of its block; $n$ elements travel as $n + 4\lceil n/B \rceil$ bytes instead of $4n$
# (fp32) or $2n$ (bf16). Per step and rank, for fp32 stage 3: $\frac{N-1}{N}\,(3 \cdot 4\Psi) \to
# \frac{N-1}{N}\,(\Psi(1 + 4/B) + 4\Psi + \Psi(1 + 4/B))$. ZeRO++'s own qgZ is hierarchical (int4,
# an all-to-all inside the node, then across nodes); minizero's is the one-hop int8 form of the same
# idea.
#
# One launch of 3 ranks: one SGD step of a 432-parameter MLP ($B = 16$ divides every chunk, so the
# formula is exact) for each variant, and a short training run of the small GPT with and without
# quantization.

# %%
import matplotlib.pyplot as plt
import minizero
from minizero.lab.quantized import LR, PSI, VARIANTS, quantized_experiment
from minizero.lab.train import TrainConfig
from minizero.memory import comm_volume

QUANT_N, BLOCK = 3, 16
QRUNS = {"stage 3": {}, "stage 3 qwZ": {"quantized_weights": True},
         "stage 3 qgZ": {"quantized_gradients": True},
         "stage 3 qwZ+qgZ": {"quantized_weights": True, "quantized_gradients": True}}
cfgs = [TrainConfig(stage=3, world_size=QUANT_N, steps=QSTEPS, model="tiny", batch_size=12, **o)
        for o in QRUNS.values()]
quant = minizero.launch(quantized_experiment, QUANT_N, cfgs, BLOCK, backend="gloo")[0]

print(f"{'variant':>16} {'measured B/step':>16} {'formula':>9}   by collective")
for name, (stage, options) in VARIANTS.items():
    tally = quant["one_step"][name]["tally"]
    formula = comm_volume(PSI, QUANT_N, stage, bytes_per_elem=4, block=BLOCK, **options)
    assert tally["total"] == formula, (name, tally, formula)
    kinds = ", ".join(f"{k} {v:.0f}" for k, v in tally.items() if k != "total")
    print(f"{name:>16} {tally['total']:16.0f} {formula:9.0f}   {kinds}")

# %% [markdown]
# **One step's error.** With qgZ each rank's chunk of its gradient $g_r$ arrives off by at most
# $absmax/254$ of its block, so the average by at most $\max_r |g_r| / 254$ and the parameters after
# one SGD step by $lr$ times that. With qwZ, forward computes with weights within $absmax/254$ of
# the exact ones (backward uses the exact ones).

# %%
bound = LR * quant["grad_max"] / 254
for stage in (2, 3):
    plain = quant["one_step"][f"stage {stage}"]["state"]
    q = quant["one_step"][f"stage {stage} qgZ"]["state"]
    err = max((plain[k] - q[k]).abs().max().item() for k in plain)
    assert err <= bound * 1.001 + 1e-7
    print(f"stage {stage} qgZ: one step's max |param - unquantized| = {err:.2e} "
          f"<= bound {bound:.2e}")
run = quant["one_step"]["stage 3 qwZ"]
initial = (quant["initial"][f"{j}.weight"] for j in (0, 2, 4))
for i, (w, seen) in enumerate(zip(initial, run["forward"])):
    print(f"qwZ layer {i}: forward weights off by {(seen - w).abs().max():.2e} <= max|w|/254 = "
          f"{w.abs().max() / 254:.2e}")
print(f"loss of that step: {quant['one_step']['stage 3']['loss']:.6f} exact, "
      f"{run['loss']:.6f} with qwZ")

# %%
fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.6))
for name, rec in zip(QRUNS, quant["runs"]):
    ax.plot(rec["losses"], label=name)
    bx.bar(name.replace("stage 3 ", "") or "exact", rec["comm_bytes_per_step"]["total"] / 1e3)
ax.set(xlabel="step", ylabel="loss", title=f"small GPT, stage 3, N = {QUANT_N}: loss")
ax.legend()
bx.set(ylabel="kB sent per step and rank", title="bytes per step (default B = 256)")
plt.tight_layout()
finals = [rec["losses"][-1] for rec in quant["runs"]]
print("final losses:", ", ".join(f"{n} {f:.4f}" for n, f in zip(QRUNS, finals)))

# %% [markdown]
# The quantized runs follow the exact one within a few thousandths of the loss, for about half the
# bytes (fp32: 12 bytes an element per step become about 6). Every stored tensor stays exact, so the
# error does not accumulate in the weights: each step's quantization error is fresh and bounded.
#
# **Exercise 13**: [`exercises/ex13_block_quantize.py`](../exercises/ex13_block_quantize.py), graded
# with `pytest exercises -k ex13`: ZeRO++'s int8 block quantization: within absmax/254 of every
# element, and the bytes qwZ and qgZ send with it.

# %% [markdown]
# ## Try it
#
# The model's prediction at any bandwidth, from the runs above: each stage's compute T (no network)
# and bytes per step S give C = S / β; a step takes between max(T, C) (all communication hidden) and
# T + C (none hidden). The measurements above fall in between: DDP hides most of its all-reduce,
# stage 1 and 2's parameter all-gather after the step hides nothing.

# %%
from ipywidgets import FloatLogSlider, interact
interact(lambda mbps: network_plots.prediction(out, mbps),
         mbps=FloatLogSlider(value=out["runs"][0]["bandwidth"] * 8 / 1e6, base=10, min=-1, max=4,
                             step=0.05, description="Mb/s"));

# %% [markdown]
# **What to try**
#
# - `python -m minizero.run --stage 0 --world-size 2 --network 100mbps` and again with
#   `--no-overlap`; `--stage 3` with `--no-prefetch`.
# - A latency-bound network (`1tbps,1ms`): many small buckets now cost hops, not bytes; raise
#   `--bucket-size-mb`.
# - `ranks_per_node=2` at N = 4: stage 3's collectives still all cross nodes. Which collectives
#   would you keep inside a node?
# - The step-through with ZeRO++'s hpZ:
#   `plots.step_widget(stepthrough.record(stepthrough.StepConfig(stage=3, world_size=4,
#   hpz_group_size=2)))`: each unit's backward all-gather now reads the "secondary partition (hpZ)"
#   kept from its forward, within pairs of ranks.
