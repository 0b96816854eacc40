"""The figures of notebooks/11_muon.ipynb (minizero.lab.muon_demo's and muon_costs' results).

    import muon_plots
    muon_plots.singular_values(whole, stacked)        # NS of the whole vs NS of the slices, stacked
    muon_plots.partitions(model, 3)                   # which rank holds which piece of which matrix
    muon_plots.costs(records)                         # each design's bytes and momentum against N
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch

from minizero.beyond.muon.pieces import matrices_of
from minizero.flat import FlatLayout
from minizero.lab.muon_costs import usual_split

DESIGN_COLORS = {"straddle": "tab:blue", "whole": "tab:green", "round_robin": "tab:orange",
                 "AdamW": "tab:gray"}


def singular_values(whole: torch.Tensor, stacked: torch.Tensor):
    """The singular values of NS(U) and of the stacked NS of U's slices."""
    fig, ax = plt.subplots(figsize=(6, 3))
    for matrix, label, color in ((whole, "NS(U): the whole matrix", "tab:blue"),
                                 (stacked, "NS of each rank's rows, stacked", "tab:red")):
        ax.plot(torch.linalg.svdvals(matrix.float()).numpy(), "o-", color=color, label=label)
    ax.axhline(1, color="black", lw=0.5)
    ax.set_xlabel("singular value index")
    ax.set_ylabel("singular value")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def partitions(model, n: int):
    """Stage 1's one bucket (every trainable parameter, end to end) cut into N partitions: each
    Muon matrix a colored span, the others gray, straddling ones hatched, the boundaries black."""
    muon = {id(p) for p in usual_split(model)[0]["params"]}
    trainable = [p for p in model.parameters() if p.requires_grad]
    bucket = FlatLayout.build([trainable], n, 0).buckets[0]
    names = {id(p): name for name, p in model.named_parameters()}
    straddling = {id(m.param) for m in matrices_of(bucket, 0, lambda p: id(p) in muon)
                  if m.straddles}
    fig, ax = plt.subplots(figsize=(10, 1.9))
    colors = plt.cm.tab20(np.linspace(0, 1, 20))
    for k, (p, offset) in enumerate(zip(bucket.params, bucket.offsets)):
        is_muon = id(p) in muon
        ax.barh(0, p.numel(), left=offset, height=0.6,
                color=colors[k % 20] if is_muon else "0.85", edgecolor="white", lw=0.3,
                hatch="///" if id(p) in straddling else None)
        if id(p) in straddling:
            ax.text(offset + p.numel() / 2, 0.45, names[id(p)], ha="center", fontsize=7)
    for r in range(n + 1):
        ax.axvline(r * bucket.shard_numel, color="black", lw=1.5)
    for r in range(n):
        ax.text((r + 0.5) * bucket.shard_numel, -0.55, f"rank {r}", ha="center", fontsize=9)
    ax.set_xlim(0, bucket.padded_numel)
    ax.set_ylim(-0.8, 0.8)
    ax.set_yticks([])
    ax.set_xlabel(f"stage 1's bucket, N = {n}: colored = Muon's matrices, hatched = straddling "
                  f"({len(straddling)}), gray = AdamW's")
    fig.tight_layout()
    return fig


def costs(records: list[dict]):
    """Per stage (panels): Muon's own bytes per step (left axis, bars per design) against N."""
    stages = sorted({r["stage"] for r in records})
    sizes = sorted({r["world_size"] for r in records})
    fig, axes = plt.subplots(1, len(stages), figsize=(3.4 * len(stages), 3.2), sharey=True,
                             squeeze=False)
    for ax, stage in zip(axes[0], stages):
        designs = [d for d in DESIGN_COLORS if d != "AdamW"
                   and any(r["design"] == d and r["stage"] == stage for r in records)]
        width = 0.8 / len(designs)
        for i, design in enumerate(designs):
            sent = [next(r["ranks"][0]["muon"] for r in records if r["world_size"] == n
                         and r["stage"] == stage and r["design"] == design) / 1e3 for n in sizes]
            ax.bar(np.arange(len(sizes)) + i * width, sent, width, color=DESIGN_COLORS[design],
                   label=design)
        ax.set_xticks(np.arange(len(sizes)) + 0.4 - width / 2, [f"N = {n}" for n in sizes])
        ax.set_title(f"stage {stage}", fontsize=10)
    axes[0][0].set_ylabel("Muon's bytes per step per rank, kB")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    return fig
