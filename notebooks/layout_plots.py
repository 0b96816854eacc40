"""The figures of notebooks/12_two_layouts.ipynb (minizero.lab.layouts' and the step-through's
results).

    import layout_plots
    layout_plots.cuts(model, units, 3)      # where each layout cuts a model at N = 3, no launch
    layout_plots.memory(reports)            # each rank's model states, both designs, formula ticks
    layout_plots.costs(reports)             # collectives' bytes, copies and step time per design
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from minizero.flat import padded_size
from minizero.pytorch.fsdp_param import padded_rows

RANK_COLORS = plt.get_cmap("tab10").colors
DESIGN_COLORS = {"flat": "tab:blue", "per-parameter": "tab:orange",
                 "per-parameter, root kept": "tab:red"}
CATEGORIES = ("params", "grads", "optimizer")


def _strips(model, units: list[list[str]], n: int) -> dict[str, list[tuple]]:
    """Per layout, (owner rank or None for padding, parameter index) of every stored element, in
    order: flat.py's rule (a unit end to end, padded to a multiple of N, cut in N) and
    fsdp_param.py's (each parameter's dim 0 cut in ceil(d0/N)-row shards)."""
    params = dict(model.named_parameters())
    flat, per_parameter = [], []
    for names in units:
        numel = sum(params[name].numel() for name in names)
        padded = padded_size(numel, n)
        owners = [j // (padded // n) for j in range(padded)]
        index = [i for i, name in enumerate(names) for _ in range(params[name].numel())]
        flat += [(owner if j < numel else None, (id(names), index[j] if j < numel else -1))
                 for j, owner in enumerate(owners)]
        for i, name in enumerate(names):
            p = params[name]
            chunk, row = padded_rows(p.shape[0], n), p[0].numel()
            for r in range(n):
                for q in range(chunk):
                    real = r * chunk + q < p.shape[0]
                    per_parameter += [(r if real else None, (id(names), i))] * row
    return {"flat (wrap's stage 3)": flat, "per-parameter (fully_shard)": per_parameter}


def cuts(model, units: list[list[str]], n: int):
    """Where each layout cuts `model` at N = n: a strip per layout, one cell per stored element,
    coloured by the rank that holds it, padding grey; thin lines between parameters, thick between
    units. Below each: the elements each rank stores, and the padding."""
    strips = _strips(model, units, n)
    width = max(len(s) for s in strips.values())
    fig, axes = plt.subplots(2, 1, figsize=(min(16, 0.22 * width + 2), 3.4))
    for ax, (title, cells) in zip(axes, strips.items()):
        for j, (owner, where) in enumerate(cells):
            color = "0.85" if owner is None else RANK_COLORS[owner % 10]
            ax.add_patch(plt.Rectangle((j, 0), 1, 1, facecolor=color, edgecolor="white",
                                       hatch="//" if owner is None else None, linewidth=0.3))
            if j and where != cells[j - 1][1]:
                ax.axvline(j, color="black", lw=2.2 if where[0] != cells[j - 1][1][0] else 0.8)
        stored = [sum(o == r for o, _ in cells) for r in range(n)]
        padding = sum(o is None for o, _ in cells)
        ax.set_xlim(0, width)
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        ax.set_xticks([])
        ax.set_title(f"{title}: rank r holds {stored} parameter elements, "
                     f"{padding} padding elements in all", fontsize=9, loc="left")
    fig.legend(handles=[Patch(color=RANK_COLORS[r % 10], label=f"rank {r}") for r in range(n)]
               + [Patch(facecolor="0.85", hatch="//", label="padding")],
               ncol=n + 1, loc="lower center", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def memory(reports: dict):
    """Each rank's model-state bytes at each N, flat beside per-parameter, stacked by category,
    the formula's total as a black tick on each bar."""
    designs = ("flat", "per-parameter")
    fig, axes = plt.subplots(1, len(reports), figsize=(4.2 * len(reports), 3.4), squeeze=False,
                             sharey=True)
    for ax, (n, report) in zip(axes[0], reports.items()):
        for d, design in enumerate(designs):
            rec = report["designs"][design]
            for r, (mem, formula) in enumerate(zip(rec["memory"], rec["formula"])):
                x, bottom = r + (d - 0.5) * 0.4, 0
                for c, cat in enumerate(CATEGORIES):
                    ax.bar(x, mem[cat] / 1e3, 0.38, bottom=bottom / 1e3,
                           color=DESIGN_COLORS[design], alpha=0.45 + 0.25 * c,
                           edgecolor="white")
                    bottom += mem[cat]
                total = sum(formula[cat] for cat in CATEGORIES)
                ax.plot([x - 0.19, x + 0.19], [total / 1e3] * 2, color="black", lw=2)
        ax.set_xticks(range(n), [f"rank {r}" for r in range(n)], fontsize=8)
        ax.set_title(f"N = {n}", fontsize=10)
    axes[0, 0].set_ylabel("model states per rank (kB)")
    axes[0, 0].legend(handles=[Patch(color=DESIGN_COLORS[d], label=d) for d in designs]
                      + [plt.Line2D([], [], color="black", lw=2, label="formula")],
                      fontsize=8, loc="lower left")
    fig.suptitle("params, grads, optimizer state (light to dark), measured; black: the formula",
                 fontsize=10)
    fig.tight_layout()
    return fig


def costs(reports: dict):
    """Per N and design: bytes a step (the ring's, modelled; gloo's, measured), bytes copied in
    memory a step (aten copy_), and the step's time by phase."""
    designs = list(next(iter(reports.values()))["designs"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    xs = np.arange(len(reports))
    w = 0.8 / len(designs)
    for d, design in enumerate(designs):
        at = xs + (d - (len(designs) - 1) / 2) * w
        recs = [rep["designs"][design] for rep in reports.values()]
        color = DESIGN_COLORS[design]
        axes[0].bar(at, [r["bytes_per_step"]["total"] / 1e3 for r in recs], w, color=color,
                    alpha=0.5, label=f"{design}: ring")
        wire = [r["wire_per_step"][0] for r in recs]
        if None not in wire:
            axes[0].plot(at, [b / 1e3 for b in wire], "o", color=color,
                         label=f"{design}: on the wire")
        axes[1].bar(at, [r["copies"]["bytes"] / 1e3 for r in recs], w, color=color, label=design)
        bottom = np.zeros(len(recs))
        for p, phase in enumerate(("forward", "backward", "step")):
            values = np.array([r["phase_times_s"][phase] * 1e3 for r in recs])
            axes[2].bar(at, values, w, bottom=bottom, color=color, alpha=0.4 + 0.25 * p,
                        edgecolor="white", label=design if p == 0 else None)
            bottom += values
    for ax, label in zip(axes, ("kB sent a step (rank 0)", "kB copied a step (rank 0)",
                                "ms a step: forward, backward, step")):
        ax.set_xticks(xs, [f"N = {n}" for n in reports])
        ax.set_ylabel(label)
    top = max(rep["designs"][d]["wire_per_step"][0] or rep["designs"][d]["bytes_per_step"]["total"]
              for rep in reports.values() for d in designs)
    axes[0].set_ylim(0, 1.9 * top / 1e3)                  # room for the legend above the bars
    for ax in axes:
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig
