"""The deck's figures, measured by minizero itself (nothing is drawn from made-up numbers).

    python slides/make_figures.py                  # -> slides/build/figures/*.png (about a minute)
    python slides/make_figures.py --small          # fewer ranks, tiny budget: seconds (tests)
    python slides/build.py                         # then the deck, with the figures inlined

What is measured: every stage (and stage 3 + offload) wraps the same GPT and takes two AdamW steps
at N = 1, 2, 4 (engine.memory() and the byte tally); the largest model each stage trains within a
budget (minizero.scale); one stage-3 step's gather/free timeline (minizero.lab.demo); minizero's
step time against PyTorch's and DeepSpeed's at two model sizes (minizero.bench, N = 2; its figure is
minizero.lab.figures.bench_ratios, as in notebook 06). minizero.lab.figures runs it all, one launch
per N. Only the paper-sized figure is the formula alone (minizero.memory), since nobody measures 7.5
B parameters on a laptop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")                       # a script: draw to files, never to a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from minizero.lab import bench  # noqa: E402
from minizero.lab.demo import unit_intervals  # noqa: E402
from minizero.lab.figures import bench_ratios, survey  # noqa: E402
from minizero.lab.scale import VARIANTS  # noqa: E402
from minizero.memory import comm_volume, estimate_breakdown  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "build", "figures")
COLORS = {
    "params": "tab:blue",
    "grads": "tab:orange",
    "optimizer": "tab:green",
    "offloaded": "tab:purple",
}
LABELS = [label for label, _, _ in VARIANTS]
FIGURES = (
    "paper_7_5b", "memory_vs_n", "breakdown", "comm", "tradeoff", "scale", "zero3_timeline",
    "bench_ratio",
)


def device_bytes(memory: dict) -> float:
    return memory["params"] + memory["grads"] + memory["optimizer"]


def measure(small: bool) -> dict:
    """Everything the figures need, as plain data (minizero.lab.figures: one launch per N)."""
    if small:
        data = survey((1, 2), width=16, budget_mb=0.5, timeline_model="tiny")
        data["bench"] = bench.compare(
            (2,), sizes=("tiny",), steps=2, repeats=1, peers=("torch",), meter=False
        )
        return data
    # 64: the default GPT's width, 8 blocks
    data = survey((1, 2, 4), width=64, budget_mb=4.0, timeline_model="default")
    data["bench"] = bench.compare((2,), sizes=("default", "1M"), steps=6, repeats=2, meter=False)
    return data


# --------------------------------------------------------------------------------------------------

def fig_paper_7_5b():
    """The paper's figure 1: Ψ = 7.5 B, N = 64, mixed-precision Adam (K = 12), formula only."""
    psi, n = 7.5e9, 64
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bottoms = np.zeros(4)
    for cat in ("params", "grads", "optimizer"):
        vals = np.array([estimate_breakdown(psi, n, s)[cat] / 1e9 for s in range(4)])
        ax.bar(range(4), vals, bottom=bottoms, color=COLORS[cat], label=cat)
        bottoms += vals
    for i, total in enumerate(bottoms):
        ax.annotate(f"{total:.1f} GB", (i, total), ha="center", va="bottom")
    ax.set_xticks(range(4), ["DDP", "stage 1\nP_os", "stage 2\nP_os+g", "stage 3\nP_os+g+p"])
    ax.set(ylabel="GB per GPU", title="Ψ = 7.5 B parameters, N = 64 GPUs (ZeRO paper's formulas)")
    ax.legend()
    return fig


def fig_memory_vs_n(data):
    """Measured device bytes per rank against N, each variant; the formula as a dashed line."""
    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = data["world_sizes"]
    for (label, stage, offload), color in zip(
        VARIANTS, plt.cm.viridis(np.linspace(0, 0.9, len(VARIANTS)))
    ):
        measured = [device_bytes(_probe(data, n, label)["memory"]) / 1e3 for n in sizes]
        psi = _probe(data, sizes[0], label)["num_params"]
        formula = [_formula_device(psi, n, stage, offload) / 1e3 for n in sizes]
        ax.plot(sizes, measured, "o-", color=color, label=label)
        ax.plot(sizes, formula, "--", color=color, alpha=0.6)
    ax.set_xticks(sizes)
    ax.set(xlabel="N (ranks)", ylabel="device model states per rank (kB)",
           title=f"Measured (dots) vs paper formula (dashed), Ψ = {psi:,}, fp32 AdamW")
    ax.legend(fontsize=8)
    return fig


def fig_breakdown(data):
    """Stacked bars at the largest N: what each rank keeps, by category
    (offloaded = host memory)."""
    n = max(data["world_sizes"])
    fig, ax = plt.subplots(figsize=(7.5, 4))
    bottoms = np.zeros(len(LABELS))
    for cat in COLORS:
        vals = np.array([_probe(data, n, label)["memory"][cat] / 1e3 for label in LABELS])
        ax.bar(
            range(len(LABELS)),
            vals,
            bottom=bottoms,
            color=COLORS[cat],
            hatch="//" if cat == "offloaded" else None,
            label=cat + (" (host)" if cat == "offloaded" else ""),
        )
        bottoms += vals
    ax.set_xticks(range(len(LABELS)), [label.replace(" + ", "\n+ ") for label in LABELS])
    ax.set(
        ylabel="kB per rank", title=f"What one of N = {n} ranks holds (measured, engine.memory())"
    )
    ax.legend(fontsize=8)
    return fig


def fig_comm(data):
    """Bytes one rank sends per step (minizero's tally) against the 2Ψ / 3Ψ ring formula."""
    n = max(data["world_sizes"])
    labels = LABELS[:4]
    sent = [_probe(data, n, label)["comm_bytes_per_step"] / 1e3 for label in labels]
    psi = _probe(data, n, labels[0])["num_params"]
    formula = [comm_volume(psi, n, s, bytes_per_elem=4) / 1e3 for s in range(4)]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar(range(4), sent, color="tab:gray", label="measured (tally)")
    ax.hlines(formula, np.arange(4) - 0.4, np.arange(4) + 0.4, colors="black", linewidth=2.5,
              label="2Ψ·(N-1)/N or 3Ψ·(N-1)/N")
    ax.set_xticks(range(4), labels)
    ax.set(ylabel="kB sent per rank per step", title=f"Communication per step, N = {n}, fp32")
    ax.legend(fontsize=8)
    return fig


def fig_tradeoff(data):
    """Memory per rank against bytes sent, both in units of Ψ·4 bytes: stage 3 buys memory
    with comm."""
    n = max(data["world_sizes"])
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label in LABELS[:4]:
        p = _probe(data, n, label)
        unit = p["num_params"] * 4
        x, y = p["comm_bytes_per_step"] / unit, device_bytes(p["memory"]) / unit
        ax.scatter(x, y, s=80)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(8, 4))
    ax.set(xlabel="sent per step (× 4Ψ bytes)", ylabel="device bytes per rank (× 4Ψ)",
           title=f"The trade-off at N = {n}: memory vs communication")
    ax.set_xlim(0, None)
    ax.set_ylim(0, None)
    return fig


def fig_scale(data):
    """Largest Ψ each variant trains within the budget, against N; N × DDP for reference."""
    rep = data["scale"]
    sizes = rep["world_sizes"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for label in LABELS:
        psi = [
            next(
                r["num_params"]
                for r in rep["rows"]
                if r["variant"] == label and r["world_size"] == n
            )
            for n in sizes
        ]
        ax.plot(sizes, psi, "o-", label=label)
    ddp1 = next(
        r["num_params"] for r in rep["rows"] if r["variant"] == "DDP" and r["world_size"] == 1
    )
    ax.plot(sizes, [ddp1 * n for n in sizes], "k:", label="N × DDP (ideal)")
    ax.set_xticks(sizes)
    ax.set(xlabel="N (ranks)", ylabel="largest Ψ that trains", yscale="log",
           title=f"Budget {rep['budget_bytes'] / 1e6:g} MB per rank (each point measured)")
    ax.legend(fontsize=8)
    return fig


def fig_zero3_timeline(data):
    """One stage-3 step: when each unit's full parameters exist, without and with prefetch."""
    fig, axes = plt.subplots(2, 1, figsize=(8, 4.2), sharex=True)
    for ax, key in zip(axes, ("False", "True")):
        rec = data["timeline"][key]
        for iv in unit_intervals(rec):
            color = "tab:blue" if iv["phase"] == "forward" else "tab:red"
            ax.barh(
                iv["unit"],
                (iv["end"] - iv["start"]) * 1e3,
                left=iv["start"] * 1e3,
                color=color,
                alpha=0.5 if iv["how"] == "prefetch" else 0.9,
            )
        ax.set_yticks(range(len(rec["unit_names"])), rec["unit_names"], fontsize=7)
        ax.set_title(f"prefetch {'on' if key == 'True' else 'off'}: peak gathered parameters "
                     f"{rec['peak_params'] / 1e3:.0f} kB", fontsize=9)
    axes[-1].set_xlabel("ms into the step (blue: forward use, red: backward use, pale: prefetched)")
    return fig


def fig_bench_ratio(data):
    """minizero's median step time over each peer's, per stage, against the model's size."""
    return bench_ratios(data["bench"])


def _probe(data, n, label):
    return next(p for p in data["probes"][n] if p["variant"] == label)


def _formula_device(psi, n, stage, offload):
    b = estimate_breakdown(psi, n, stage, param_bytes=4, grad_bytes=4, k=8, offload=offload)
    return b["params"] + b["grads"] + b["optimizer"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="measure with minizero and draw the deck's figures")
    ap.add_argument(
        "--out", default=DEFAULT_OUT, help=f"folder for the PNGs (default {DEFAULT_OUT})"
    )
    ap.add_argument("--small", action="store_true", help="quick: N = 1, 2, tiny models (for tests)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    data = measure(args.small)
    with open(os.path.join(args.out, "measurements.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    for name in FIGURES:
        draw = globals()[f"fig_{name}"]
        fig = draw() if name == "paper_7_5b" else draw(data)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, f"{name}.png"), dpi=110)
        plt.close(fig)
    print(f"wrote {len(FIGURES)} figures to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
