"""The figures and tables of notebooks/10_tensor_parallel.ipynb (minizero.lab.mesh_demo's results).

    import mesh_plots
    mesh_plots.memory_across_the_mesh(runs)        # measured per rank next to the formula with M
    mesh_plots.show_phase(steps, 0)     # collective 1 of one step on the 2 x 2 mesh, every rank
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from plots import COLORS, KB, STAGE_NAMES, _formula_ticks, phase_code

CATEGORIES = ("params", "grads", "optimizer")


def mesh_name(record: dict) -> str:
    m = record["tensor_parallel"]
    return f"{m} x {record['world_size'] // m}"


def memory_across_the_mesh(records: list[dict]):
    """Rank 0's model states at every stage (panels) on every mesh (bars): measured, stacked by
    category, with the formula with M as a black tick on each."""
    stages = sorted({r["stage"] for r in records})
    meshes = list(dict.fromkeys(mesh_name(r) for r in records))
    fig, axes = plt.subplots(1, len(stages), figsize=(3.2 * len(stages), 3.8), sharey=True,
                             squeeze=False)
    for ax, stage in zip(axes[0], stages):
        runs = {mesh_name(r): r for r in records if r["stage"] == stage}
        xs = np.arange(len(meshes))
        bottom = np.zeros(len(meshes))
        for cat in CATEGORIES:
            measured = np.array([runs[m]["ranks"][0]["memory"][cat] / KB for m in meshes])
            ax.bar(xs, measured, 0.6, bottom=bottom, color=COLORS[cat], label=cat)
            bottom += measured
        _formula_ticks(ax, xs, [sum(runs[m]["theory"][c] for c in CATEGORIES) / KB
                                for m in meshes], 0.6, label="formula with M")
        ax.set_xticks(xs, meshes)
        ax.set_xlabel("N_m x N_d")
        ax.set_title(STAGE_NAMES[stage], fontsize=10)
    axes[0][0].set_ylabel("model states per rank, kB")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def activations(records: list[dict], estimates: dict):
    """Rank 0's bytes saved for backward (the activation meter) per checkpointing mode, next to
    memory.activation_bytes with M (`estimates`: {mode: bytes})."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [str(r["activation_checkpointing"]) for r in records]
    xs = np.arange(len(records))
    ax.bar(xs, [r["ranks"][0]["memory"]["activations"] / KB for r in records], 0.6,
           color="tab:red", label="measured (activation meter)")
    _formula_ticks(ax, xs, [estimates[label] / KB for label in labels], 0.6,
                   label="activation_bytes(..., tensor_parallel=M)")
    ax.set_xticks(xs, ["kept (no checkpointing)" if x == "False" else x for x in labels])
    ax.set_ylabel("activations per rank, kB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _values(values: list[float] | None) -> str:
    return "" if values is None else "[" + ", ".join(f"{v:+.3g}" for v in values) + ", ...]"


def phase_table(steps: dict, k: int) -> str:
    """Collective k of the recorded step on every rank: its group, what it held before and
    after (the first values)."""
    first = steps["ranks"][0][k]
    axis = "row (tensor parallel)" if first["tag"].startswith("tensor parallel") else \
        "column (ZeRO, data parallel)"
    lines = [f"collective {k + 1} of {len(steps['ranks'][0])}: {first['kind']} '{first['tag']}' "
             f"over each {axis}, {first['numel']} elements"]
    for rank, phases in enumerate(steps["ranks"]):
        p = phases[k]
        lines.append(f"  rank {rank} with {p['group']}:  before {_values(p['before'])}")
        lines.append(f"  {'':>{len(str(p['group'])) + 12}}after  {_values(p.get('after'))}")
    return "\n".join(lines)


def show_phase(steps: dict, k: int):
    """Collective k on every rank (phase_table), then the function of minizero that issued it,
    read from its file now, its line marked: what a notebook cell displays."""
    print(phase_table(steps, k))
    return phase_code(steps["ranks"][0][k]["source"])
