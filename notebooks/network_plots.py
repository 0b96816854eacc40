"""The figures of notebooks/08_beyond.ipynb's network-model sections
(minizero.lab.network_runs' results).

    import network_plots
    network_plots.timelines(out, ["DDP", "DDP, no overlap"])
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from minizero.lab.network_runs import predict

STAGE_NAMES = {0: "DDP", 1: "stage 1", 2: "stage 2", 3: "stage 3"}


def timelines(out: dict, labels: list[str]):
    """One recorded step per run, rank 0: the modelled link's transfers (bars) under the compute
    events (ticks: each block's backward starting, end of backward)."""
    runs = {run["label"]: run for run in out["runs"]}
    fig, ax = plt.subplots(figsize=(9, 0.8 + 0.7 * len(labels)))
    for row, label in enumerate(labels):
        tl = runs[label]["timeline"]
        y = len(labels) - 1 - row
        ax.broken_barh(
            [(a * 1e3, (b - a) * 1e3) for a, b, _ in tl["transfers"]],
            (y - 0.3, 0.35),
            facecolors="tab:orange",
            edgecolor="white",
            label="link busy (model)" if row == 0 else None,
        )
        compute = [
            t * 1e3 for t, event in tl["events"] if event.startswith(("forward", "backward"))
        ]
        ax.vlines(
            compute,
            y + 0.1,
            y + 0.4,
            colors="tab:blue",
            label="a block's forward ends / backward starts" if row == 0 else None,
        )
        done = [t * 1e3 for t, event in tl["events"] if event == "end of backward"]
        ax.plot(
            done,
            [y + 0.25] * len(done),
            "k|",
            markersize=16,
            label="end of backward" if row == 0 else None,
        )
        ax.text(tl["end"] * 1e3, y, f" {tl['end'] * 1e3:.0f} ms", va="center")
    ax.set_yticks(range(len(labels)), labels[::-1])
    ax.set_xlabel("time since the step started (ms)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=8)
    fig.tight_layout()
    return fig


def step_times(out: dict, labels: list[str]):
    """Each run's fastest step (bars), with every step after the first as a dot."""
    runs = {run["label"]: run for run in out["runs"]}
    fig, ax = plt.subplots(figsize=(7, 3))
    for x, label in enumerate(labels):
        times = [t * 1e3 for t in runs[label]["step_times"][1:]]
        ax.bar(
            x, runs[label]["step_time_s"] * 1e3, 0.6, color="tab:green" if x % 2 == 0 else "tab:red"
        )
        ax.plot([x] * len(times), times, "k.", alpha=0.6)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("step time (ms)")
    fig.tight_layout()
    return fig


def bandwidth_sweep(out: dict):
    """Step time (fastest step) of every stage against bandwidth (falling to the right); dashed:
    no network."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for stage in sorted({run["stage"] for run in out["runs"]}):
        mine = [run for run in out["runs"] if run["label"].startswith(f"stage {stage}, ratio")]
        shaped = sorted(
            (run for run in mine if run["ratio"] is not None), key=lambda run: -run["bandwidth"]
        )
        (line,) = ax.plot(
            [run["bandwidth"] * 8 / 1e6 for run in shaped],
            [run["step_time_s"] * 1e3 for run in shaped],
            "o-",
            label=STAGE_NAMES[stage],
        )
        free = [run["step_time_s"] * 1e3 for run in mine if run["ratio"] is None]
        ax.axhline(free[0], color=line.get_color(), linestyle="--", linewidth=0.8)
    ax.set_xscale("log")
    ticks = sorted({run["bandwidth"] * 8 / 1e6 for run in out["runs"] if run["ratio"] is not None})
    ax.set_xticks(ticks, [f"{t:.3g}" for t in ticks], minor=False)
    ax.minorticks_off()
    ax.invert_xaxis()
    ax.set_xlabel("modelled bandwidth (Mb/s; dashed: no network model)")
    ax.set_ylabel("step time (ms)")
    ax.legend()
    fig.tight_layout()
    return fig


def prediction(out: dict, bandwidth_mbps: float):
    """The model's prediction per stage at a bandwidth: from max(T, C) (all hidden) to
    T + C (none)."""
    predicted = predict(out, bandwidth_mbps * 1e6 / 8)
    fig, ax = plt.subplots(figsize=(6, 3))
    stages = sorted(predicted)
    for x in stages:
        p = predicted[x]
        ax.bar(
            x, p["compute_s"] * 1e3, 0.6, color="tab:blue", label="compute T" if x == 0 else None
        )
        ax.bar(
            x,
            (p["serial_s"] - p["compute_s"]) * 1e3,
            0.6,
            bottom=p["compute_s"] * 1e3,
            color="tab:orange",
            alpha=0.4,
            label="communication C, not hidden" if x == 0 else None,
        )
        ax.hlines(
            p["hidden_s"] * 1e3,
            x - 0.3,
            x + 0.3,
            colors="black",
            label="max(T, C): all hidden" if x == 0 else None,
        )
    ax.set_xticks(stages, [STAGE_NAMES[s] for s in stages])
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(f"{bandwidth_mbps:g} Mb/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
