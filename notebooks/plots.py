"""The figures the notebooks draw, shared so that every notebook draws the same thing the same way.

    import plots                               # from a notebook in this folder
    plots.memory_by_category(runs, "ZeRO stage 2")

Every function takes the records minizero.lab.demo returns (measured numbers next to the paper's
formulas) or the formulas of minizero.memory, and returns the matplotlib figure. Units are in the
axis labels: kB for the small GPT's model states, MB for the collectives' tensors, GB for
paper-sized models.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from minizero.lab.train import state_bytes
from minizero.memory import (
    comm_volume, element_bytes, estimate, estimate_breakdown, optimizer_k,
)

COLORS = {
    "params": "tab:blue",
    "grads": "tab:orange",
    "optimizer": "tab:green",
    "offloaded": "tab:purple",
}
STAGE_NAMES = {0: "DDP", 1: "stage 1 (P_os)", 2: "stage 2 (P_os+g)", 3: "stage 3 (P_os+g+p)"}
KB, MB, GB = 1e3, 1e6, 1e9


def _formula_ticks(ax, xs, ys, width, label="formula (ZeRO paper)"):
    """A black bar across the top of each bar, where the formula says it should end."""
    for i, (x, y) in enumerate(zip(xs, ys)):
        ax.hlines(y, x - width / 2, x + width / 2, colors="black", linewidth=2.5,
                  label=label if i == 0 else None)


def loss_curves(runs: dict, title: str):
    """Mean loss over ranks per step for each N, on top of the single-process reference."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    any_run = next(iter(runs.values()))
    steps = np.arange(1, len(any_run["reference_losses"]) + 1)
    ax.plot(
        steps,
        any_run["reference_losses"],
        "k-",
        linewidth=5,
        alpha=0.3,
        label="reference (1 process)",
    )
    for n, rec in sorted(runs.items()):
        ax.plot(steps, rec["losses"], "--", marker=".", label=f"N = {n}")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set(xlabel="optimizer step", ylabel="loss (cross-entropy, nats)", title=title)
    ax.legend()
    fig.tight_layout()
    return fig


def memory_by_category(runs: dict, title: str):
    """Grouped bars: rank 0's measured bytes per category for each world size, formula as
    black ticks."""
    cats = [
        c
        for c in COLORS
        if any(rec["theory"][c] or rec["ranks"][0]["memory"][c] for rec in runs.values())
    ]
    sizes = sorted(runs)
    width = 0.8 / len(cats)
    fig, ax = plt.subplots(figsize=(8.5, 4))
    for j, cat in enumerate(cats):
        xs = np.arange(len(sizes)) + (j - (len(cats) - 1) / 2) * width
        measured = [runs[n]["ranks"][0]["memory"][cat] / KB for n in sizes]
        ax.bar(xs, measured, width * 0.9, color=COLORS[cat],
               label=f"{cat} (measured)" + (", host" if cat == "offloaded" else ""))
        _formula_ticks(ax, xs, [runs[n]["theory"][cat] / KB for n in sizes], width * 0.9,
                       label="formula (ZeRO paper)" if j == 0 else None)
    for i, n in enumerate(sizes):           # the device total above each group
        top = max(max(runs[n]["ranks"][0]["memory"][c], runs[n]["theory"][c]) for c in cats) / KB
        total = _device_bytes(runs[n]["ranks"][0]["memory"]) / KB
        ax.annotate(
            f"device total\n{total:.1f} kB",
            (i, top),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylim(top=ax.get_ylim()[1] * 1.2)
    rec = runs[sizes[0]]
    ax.set_xticks(np.arange(len(sizes)), [f"N = {n}" for n in sizes])
    ax.set(ylabel="bytes per rank (kB)",
           title=f"{title}: model states per rank, Ψ = {rec['num_params']:,}, {rec['dtype']}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def collective_bytes(results: dict):
    """Left: bytes rank 0 sent per collective at the largest N: modelled (comm.tally, the ring
    formula) next to measured (on the wire, memory/wire.py; absent where it cannot measure), ring
    formula ticks. Right: measured bytes / the tensor's size S against N, with the ring's curves:
    all-reduce 2(N-1)/N, the others (N-1)/N."""
    formulas = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
                "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: (n - 1) / n,
                "ring_all_reduce": lambda n: 2 * (n - 1) / n}
    n_max = max(results)
    top = results[n_max]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    kinds = list(formulas)
    xs = np.arange(len(kinds))
    left.bar(xs - 0.2, [top["sent"][k] / MB for k in kinds], 0.4, color="tab:blue",
             label="modelled (comm.tally)")
    if top["wire"] is not None:
        left.bar(xs + 0.2, [top["wire"][k] / MB for k in kinds], 0.4, color="tab:orange",
                 label="measured (on the wire)")
    _formula_ticks(left, xs, [formulas[k](n_max) * top["full_bytes"] / MB for k in kinds], 0.8,
                   label="ring formula")
    left.set_xticks(xs, [k.replace("_", "\n") for k in kinds])
    left.set(ylabel="bytes rank 0 sent (MB)",
             title=f"N = {n_max}, tensor S = {top['full_bytes'] / MB:.3g} MB (fp32)")
    left.legend(fontsize=8)
    ns = np.arange(2, 17)
    for label, f, style in (
        ("ring: 2(N-1)/N (all-reduce)", formulas["all_reduce"], "-"),
        ("ring: (N-1)/N (the others)", formulas["all_gather"], "--"),
    ):
        right.plot(ns, [f(n) for n in ns], "k" + style, label=label)
    sizes = sorted(results)
    measured = "wire" if top["wire"] is not None else "sent"
    for kind, marker in zip(kinds, "os^vx"):
        right.plot(
            sizes,
            [results[n][measured][kind] / results[n]["full_bytes"] for n in sizes],
            marker,
            linestyle="none",
            markersize=8,
            fillstyle="none",
            label=f"{kind} ({'on the wire' if measured == 'wire' else 'tally'})",
        )
    right.set(xlabel="world size N", ylabel="bytes rank 0 sent / S", ylim=(0, 3.1),
              title="Rank 0's traffic per collective, against N")
    right.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def device_vs_host(variants: dict, title: str):
    """Two panels, device and host bytes per rank, for each variant and world size;
    formula ticks."""
    names = list(variants)
    sizes = sorted(next(iter(variants.values())))
    width = 0.8 / len(names)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, where in zip(axes, ("device", "host")):
        for j, name in enumerate(names):
            xs = np.arange(len(sizes)) + (j - (len(names) - 1) / 2) * width
            recs = [variants[name][n] for n in sizes]
            measured = [_device_bytes(r["ranks"][0]["memory"]) if where == "device"
                        else r["ranks"][0]["memory"]["offloaded"] for r in recs]
            formula = [
                r["theory"]["device_total"] if where == "device" else r["theory"]["offloaded"]
                for r in recs
            ]
            ax.bar(xs, np.array(measured) / KB, width * 0.9, label=name, color=f"C{j}")
            _formula_ticks(ax, xs, np.array(formula) / KB, width * 0.9,
                           label="formula" if j == 0 else None)
        ax.set_xticks(np.arange(len(sizes)), [f"N = {n}" for n in sizes])
        ax.set(ylabel="bytes per rank (kB)", title=f"{where} memory per rank")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _device_bytes(memory: dict) -> float:
    return memory["params"] + memory["grads"] + memory["optimizer"]


def unit_timeline(timelines: dict, intervals: dict):
    """One row per stage-3 unit: when its full parameters exist, forward then backward, prefetch off
    (left) and on (right), on one time scale. A hatched bar was started by a prefetch (gathered
    ahead of its use)."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), sharey=True, sharex=True)
    for ax, prefetch in zip(axes, (False, True)):
        rec = timelines[prefetch]
        names = rec["unit_names"]
        for iv in intervals[prefetch]:
            color = "tab:blue" if iv["phase"] == "forward" else "tab:red"
            ax.barh(iv["unit"], (iv["end"] - iv["start"]) * 1e3, left=iv["start"] * 1e3, height=0.6,
                    color=color, alpha=0.75, hatch="//" if iv["how"] == "prefetch" else None,
                    edgecolor="black", linewidth=0.5)
        for mark, style in (("backward", "--"), ("step", ":")):
            ax.axvline(
                rec["marks"][mark] * 1e3, color="gray", linestyle=style, label=f"{mark} starts"
            )
        ax.set_yticks(range(len(names)), names)
        ax.set(
            xlabel="time in the step (ms)",
            title=(
                f"prefetch {'on' if prefetch else 'off'}: peak "
                f"parameters {rec['peak_params'] / KB:.0f} kB "
                f"(full model {rec['num_params'] * 4 / KB:.0f} kB)"
            ),
        )
        ax.invert_yaxis()
    axes[0].set_ylabel("unit (rank 0)")
    handles = axes[1].get_legend_handles_labels()[0] + [
        Patch(color="tab:blue", alpha=0.75, label="gathered for forward"),
        Patch(color="tab:red", alpha=0.75, label="gathered for backward"),
        Patch(facecolor="white", hatch="//", edgecolor="black", label="started by a prefetch")]
    axes[1].legend(handles=handles, fontsize=7, loc="lower right")
    fig.suptitle("When each unit exists, on loopback: the steps' lengths are not prefetch's doing "
                 "(see the text; notebook 08 models a network)", fontsize=9)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------------
# 06_compare: all stages, measured and from the estimator
# --------------------------------------------------------------------------------------------------

def compare_measured(stages: dict):
    """Three panels from the same runs: device memory per rank vs N on the formula curves, bytes
    sent per step at the largest N vs 2Ψ / 3Ψ, and the step time: a bar at the median, a dot for
    every step (on shared cores the spread is often wider than the difference between two bars)."""
    fig, (mem, com, tim) = plt.subplots(1, 3, figsize=(15, 4))
    sizes = sorted(next(iter(stages.values())))
    ns = np.arange(1, max(sizes) * 2 + 1)
    for stage, runs in stages.items():
        rec = runs[sizes[0]]
        elem = element_bytes(rec["dtype"])
        k = optimizer_k(state_bytes(rec["optimizer"]), rec["dtype"])
        curve = [
            estimate(rec["num_params"], n, stage, param_bytes=elem, grad_bytes=elem, k=k)
            for n in ns
        ]
        mem.plot(ns, np.array(curve) / KB, color=f"C{stage}", label=f"{STAGE_NAMES[stage]} formula")
        mem.plot(sizes, [_device_bytes(runs[n]["ranks"][0]["memory"]) / KB for n in sizes], "o",
                 color=f"C{stage}", markersize=8, markeredgecolor="black")
    mem.plot([], [], "ko", label="measured (rank 0)")
    mem.set(
        xlabel="world size N", ylabel="model states per rank (kB)", title="Memory per rank vs N"
    )
    mem.legend(fontsize=7)

    n_max = max(sizes)
    xs = np.arange(len(stages))
    recs = [runs[n_max] for runs in stages.values()]
    com.bar(xs, [r["ranks"][0]["comm_bytes_per_step"]["total"] / KB for r in recs], 0.6,
            color=[f"C{s}" for s in stages], label="sent (comm.tally)")
    _formula_ticks(com, xs, [r["theory"]["comm_bytes_per_step"] / KB for r in recs], 0.6,
                   label="2Ψ (stages 0-2), 3Ψ (stage 3) × (N-1)/N")
    com.set_xticks(xs, [STAGE_NAMES[s].replace(" (", "\n(") for s in stages], fontsize=8)
    com.set(
        ylabel="bytes sent per rank per step (kB)", title=f"Communication per step, N = {n_max}"
    )
    com.legend(fontsize=7, loc="upper left")

    width = 0.8 / len(sizes)
    for j, n in enumerate(sizes):
        at = xs + (j - (len(sizes) - 1) / 2) * width
        tim.bar(
            at,
            [runs[n]["step_time_s"] * 1e3 for runs in stages.values()],
            width * 0.9,
            label=f"N = {n}",
            color=plt.cm.Greys(0.2 + 0.4 * j / max(1, len(sizes) - 1)),
        )
        for x, runs in zip(at, stages.values()):
            times = np.array(runs[n]["step_times_s"]) * 1e3
            tim.plot(
                np.full(len(times), x) + np.linspace(-0.25, 0.25, len(times)) * width,
                times,
                ".",
                color="black",
                markersize=3,
            )
    tim.plot([], [], "k.", markersize=3, label="each step (rank 0)")
    tim.set_xticks(xs, [STAGE_NAMES[s].replace(" (", "\n(") for s in stages], fontsize=8)
    tim.set(
        ylabel="step time (ms): bar = median",
        title="Step time, every step (CPU processes: a rough guide)",
    )
    tim.legend(fontsize=7)
    fig.tight_layout()
    return fig


def largest_model(budget_bytes: float, dtype: str = "bf16", max_world_size: int = 1024):
    """The largest Ψ whose model states fit `budget_bytes` per rank, per stage, against
    N (estimator)."""
    pb, k = element_bytes(dtype), optimizer_k(state_bytes("adamw"), dtype)    # Adam: K = 12 in bf16
    ns = 2 ** np.arange(0, int(np.log2(max_world_size)) + 1)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for stage in STAGE_NAMES:
        psi = [
            budget_bytes / estimate(1, int(n), stage, param_bytes=pb, grad_bytes=pb, k=k)
            for n in ns
        ]
        ax.loglog(
            ns, np.array(psi) / 1e9, marker="o", color=f"C{stage}", label=STAGE_NAMES[stage], base=2
        )
    ax.set_yscale("log", base=10)
    ax.set(
        xlabel="world size N",
        ylabel="largest model (billion parameters)",
        title=(
            f"What fits in {budget_bytes / GB:.0f} GB per rank ({dtype}, Adam; model states only)"
        ),
    )
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def estimator_view(world_size: int, params_billion: float, dtype: str, budget_gb: float):
    """Per-rank GB by category for each stage, for a model of `params_billion`, against a
    budget line."""
    pb, k = element_bytes(dtype), optimizer_k(state_bytes("adamw"), dtype)    # Adam: K = 12 in bf16
    psi = params_billion * 1e9
    fig, (bars, comm) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [2, 1]})
    bottom = np.zeros(len(STAGE_NAMES))
    for cat in ("params", "grads", "optimizer"):
        values = (
            np.array(
                [
                    estimate_breakdown(psi, world_size, s, param_bytes=pb, grad_bytes=pb, k=k)[cat]
                    for s in STAGE_NAMES
                ]
            )
            / GB
        )
        bars.bar(list(STAGE_NAMES.values()), values, bottom=bottom, color=COLORS[cat], label=cat)
        bottom += values
    bars.axhline(budget_gb, color="red", linestyle="--", label=f"budget {budget_gb:g} GB")
    bars.set(
        ylabel="model states per rank (GB)",
        title=f"Ψ = {params_billion:g} B parameters, N = {world_size}, {dtype} + Adam (K = {k})",
    )
    bars.legend(fontsize=8)
    volumes = [comm_volume(psi, world_size, s, bytes_per_elem=pb) / GB for s in STAGE_NAMES]
    comm.bar([f"{s}" for s in STAGE_NAMES], volumes, color=[f"C{s}" for s in STAGE_NAMES])
    comm.set(
        xlabel="stage (0 = DDP)", ylabel="bytes sent per rank per step (GB)", title="Communication"
    )
    fig.tight_layout()
    plt.show()


def lora_memory(rows: list[dict]):
    """Fine-tuning at stage 3: parameter bytes per rank vs N (measured, the formula, and what
    replicating the frozen base would cost), and what building the model held, with and
    without sharded_init."""
    fig, (mem, build) = plt.subplots(1, 2, figsize=(12, 4))
    ns = [r["world_size"] for r in rows]
    xs = np.arange(len(rows))
    mem.bar(xs - 0.2, [r["replicated_frozen_would_be"] / KB for r in rows], 0.4, color="0.8",
            label="if the frozen base were replicated (stages 0-2, or not sharding it)")
    mem.bar(
        xs + 0.2,
        [r["params"] / KB for r in rows],
        0.4,
        color="C3",
        label="measured, rank 0 (frozen sharded)",
    )
    _formula_ticks(mem, xs + 0.2, [r["formula"] / KB for r in rows], 0.4, label="(Ψ + Ψ_f)·4/N")
    mem.set_xticks(xs, [f"N = {n}" for n in ns])
    mem.set(ylabel="parameter bytes per rank (kB)", title="LoRA: the frozen base is sharded too")
    _legend_above_bars(mem)
    build.bar(xs - 0.2, [r["construction_peak"]["normal"] / KB for r in rows], 0.4, color="0.6",
              label="built normally: the whole model")
    build.bar(
        xs + 0.2,
        [r["construction_peak"]["sharded_init"] / KB for r in rows],
        0.4,
        color="C2",
        label="built under minizero.sharded_init",
    )
    build.set_xticks(xs, [f"N = {n}" for n in ns])
    build.set(
        ylabel="parameter bytes held while building (kB)", title="Building the model, per rank"
    )
    _legend_above_bars(build)
    fig.tight_layout()
    return fig


def _legend_above_bars(ax, room: float = 1.45):
    """The legend in headroom above the tallest bar (the y range grown by `room`), never over a
    bar."""
    ax.set_ylim(0, ax.get_ylim()[1] * room)
    ax.legend(fontsize=7, loc="upper right")


def moved_run(rec: dict):
    """The loss of a run moved from N = from_n to N = to_n at step `half`, on the
    uninterrupted one."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = np.arange(1, len(rec["full"]) + 1)
    ax.plot(
        steps,
        rec["full"],
        "k-",
        linewidth=5,
        alpha=0.3,
        label=f"uninterrupted, N = {rec['from_n']}",
    )
    later = steps[rec["half"]:]
    ax.plot(
        later,
        rec["resumed"],
        "--",
        marker=".",
        label=f"resumed at N = {rec['to_n']}, optimizer state resharded",
    )
    ax.plot(
        later,
        rec["fresh"],
        ":",
        marker="x",
        label=f"restarted at N = {rec['to_n']}, fresh optimizer",
    )
    ax.axvline(rec["half"] + 0.5, color="gray", linewidth=0.8)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set(xlabel="optimizer step", ylabel="loss (mean over ranks)",
           title=f"a run moved from {rec['from_n']} to {rec['to_n']} ranks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --- 07_activations -------------------------------------------------------------------------------
MODE_NAMES = {False: "kept", True: "checkpointed", "cpu": "checkpointed, inputs on the host"}


def activation_sweep(rows: list[dict]):
    """Activations per rank against sequence length (largest micro-batch) and micro-batch (longest
    sequence): dots measured, lines memory.activation_bytes, one colour per checkpointing mode."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    longest, largest = max(r["seq"] for r in rows), max(r["batch"] for r in rows)
    for ax, (x, fixed, value) in zip(axes, (("seq", "batch", largest), ("batch", "seq", longest))):
        for mode, name in MODE_NAMES.items():
            pts = sorted((r[x], r["measured"], r["estimate"]) for r in rows
                         if r["checkpointing"] == mode and r[fixed] == value)
            (line,) = ax.plot(
                [p[0] for p in pts], [p[2] / KB for p in pts], "-", label=f"{name}: estimate"
            )
            ax.plot([p[0] for p in pts], [p[1] / KB for p in pts], "o", color=line.get_color(),
                    label=f"{name}: measured")
        ax.set(
            xlabel="sequence length s" if x == "seq" else "micro-batch b",
            ylabel="activations per rank (kB)",
            title=f"{fixed} = {value}",
        )
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def full_memory(records: dict):
    """Rank 0's device bytes per stage: model states stacked with activations, without (left bar of
    each pair) and with checkpointing (right)."""
    fig, ax = plt.subplots(figsize=(8, 4))
    stages = sorted({s for s, _ in records})
    for i, s in enumerate(stages):
        for j, mode in enumerate((False, True)):
            m = records[(s, mode)]["ranks"][0]["memory"]
            x, bottom = i + (j - 0.5) * 0.4, 0.0
            for cat in ("params", "grads", "optimizer", "activations"):
                color = COLORS.get(cat, "tab:red")
                ax.bar(
                    x,
                    m[cat] / KB,
                    0.38,
                    bottom=bottom / KB,
                    color=color,
                    hatch="//" if mode else None,
                    label=cat if (i, j) == (0, 0) else None,
                )
                bottom += m[cat]
    ax.set_xticks(range(len(stages)), [f"{STAGE_NAMES[s]}\nkept | ckpt" for s in stages])
    ax.set(
        ylabel="device bytes per rank (kB)",
        title="Model states + activations per rank (hatched: checkpointed)",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def memory_timeline(records: list[dict]):
    """One step of rank 0, event by event: bytes by category stacked (the shape of PyTorch's CUDA
    memory snapshot, measured here by the engine itself)."""
    fig, axes = plt.subplots(len(records), 1, figsize=(11, 2.6 * len(records)), squeeze=False)
    cats = ("params", "grads", "optimizer", "activations")
    for ax, rec in zip(axes[:, 0], records):
        events = rec["events"]
        ys = [[b[c] / KB for _, _, b in events] for c in cats]
        ax.stackplot(range(len(events)), ys, labels=cats, step="post",
                     colors=[COLORS.get(c, "tab:red") for c in cats])
        ax.set_xticks(
            range(len(events)), [e for _, e, _ in events], rotation=60, ha="right", fontsize=7
        )
        ax.set(
            ylabel="kB", title=f"{STAGE_NAMES[rec['stage']]}, {MODE_NAMES[rec['checkpointing']]}"
        )
    axes[0, 0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


# --- 05_offload, last section: the loss scale of an fp16 run --------------------------------------
def loss_scale_trajectory(run: dict):
    """The scale each step's gradients carried (rank 0; every rank's is the same), the steps every
    rank skipped, and which rank's partition held the injected inf."""
    trace = run["ranks"][0]["trace"]
    steps = [t["step"] for t in trace]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.step(
        steps,
        [t["scale"] for t in trace],
        where="post",
        color="tab:blue",
        label="loss scale S at the step",
    )
    skipped = [t for t in trace if t["skipped"]]
    ax.scatter(
        [t["step"] for t in skipped],
        [t["scale"] for t in skipped],
        marker="x",
        s=80,
        color="tab:red",
        zorder=3,
        label="skipped by every rank",
    )
    scales = [t["scale"] for t in trace]
    ax.set_yscale("log", base=2)
    ax.set_ylim(min(scales) / 1.5, max(scales) * 4)            # room above the line for the labels
    for k, r in run["faults"].items():
        ax.axvline(int(k), color="gray", linewidth=0.8, linestyle=":")
        ax.annotate(
            f"inf on rank {r}",
            (int(k), ax.get_ylim()[1]),
            rotation=90,
            fontsize=7,
            va="top",
            ha="right",
            color="gray",
        )
    ax.xaxis.get_major_locator().set_params(integer=True)
    opts = run["loss_scale"]
    ax.set(xlabel="step", ylabel="loss scale S",
           title=f"fp16, N = {run['world_size']}: window {opts['loss_scale_window']}, "
                 f"hysteresis {opts['hysteresis']}")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    return fig


# --- one step, rank by rank (minizero.lab.stepthrough): notebooks 00-05, 07 and 08 ----------------
def _cells(values) -> np.ndarray:
    return np.array([[np.nan if v is None else v for v in row] for row in values], dtype=float)


def _pad_columns(buckets: list[dict]) -> set[int]:
    return {j for b in buckets for j in range(b["start"] + b["numel"], b["start"] + b["padded"])}


def _boundaries(steps: dict) -> list[tuple[int, str]]:
    """(column, "bucket" | "partition") where a bucket or, when partitioned, a rank's
    partition starts."""
    out = []
    for b in steps["buckets"]:
        out.append((b["start"], "bucket"))
        if steps["partitioned"]:
            out += [
                (b["start"] + q * b["shard"], "partition")
                for q in range(1, b["padded"] // b["shard"])
            ]
    return out


def _ran(where: dict | None) -> str:
    """'  <- minizero/zero3.py:170 Unit.free': the line of minizero a phase came from."""
    return "" if where is None else f"  <- {where['file']}:{where['line']} {where['function']}"


def phase_code(where: dict | None, title: str = ""):
    """The function of minizero that produced a phase, read from its file now, its line marked
    (minizero.lab.source.Code; shown highlighted in a notebook)."""
    from minizero.lab.source import Code
    return None if where is None else Code(where["file"], where["line"], title=title)


def step_table(steps: dict) -> str:
    """Every phase as text: each buffer that changed, one line per rank (· not held, pad: padding,
    | a partition boundary, ‖ a bucket boundary). The static view of the step-through."""
    pad, cuts = _pad_columns(steps["buckets"]), dict(_boundaries(steps))
    lines, previous = [], None

    def cell(j, v):
        sep = {"bucket": " ‖", "partition": " |"}.get(cuts.get(j), "") if j else ""
        return sep + ("     ·" if v is None else "   pad" if j in pad else f"{v:6.2f}")

    for k, phase in enumerate(steps["phases"]):
        lines.append(f"[{k}] {phase['label']}{_ran(phase.get('source'))}")
        for name in phase["ranks"][0]:
            rows = [rank[name] for rank in phase["ranks"]]
            if previous is not None and rows == [rank[name] for rank in previous["ranks"]]:
                continue
            for r, row in enumerate(rows):
                lines.append(
                    f"    {name if r == 0 else '':>22} rank {r}"
                    + "".join(cell(j, v) for j, v in enumerate(row))
                )
        previous = phase
    return "\n".join(lines)


def step_grid(steps: dict, phase: int):
    """One phase of the step-through: per buffer, a grid with a row per rank and a column per
    element of the padded flat buffer; values in the cells, blank where a rank does not hold the
    element, padding hatched, partition boundaries dashed and bucket boundaries solid, values that
    changed in this phase in bold with a black frame."""
    ph, phases = steps["phases"][phase], steps["phases"]
    prev = phases[phase - 1] if phase else None
    names, n, cols = list(ph["ranks"][0]), len(ph["ranks"]), steps["padded"]
    pad = _pad_columns(steps["buckets"])
    fig, axes = plt.subplots(
        len(names),
        1,
        figsize=(0.62 * cols + 2.6, (0.34 * n + 0.5) * len(names) + 1.5),
        squeeze=False,
    )
    cmap = plt.get_cmap("coolwarm").copy()
    cmap.set_bad("white")
    for ax, name in zip(axes[:, 0], names):
        vals = _cells([rank[name] for rank in ph["ranks"]])
        everything = np.concatenate(
            [_cells([rank[name] for rank in p["ranks"]]).ravel() for p in phases]
        )
        scale = np.nanmax(np.abs(everything)) if np.isfinite(everything).any() else 1.0
        ax.imshow(np.ma.masked_invalid(vals), cmap=cmap, vmin=-scale, vmax=scale, aspect="auto")
        before = (
            _cells([rank[name] for rank in prev["ranks"]]) if prev else np.full_like(vals, np.nan)
        )
        for j in sorted(pad):
            ax.axvspan(j - 0.5, j + 0.5, facecolor="0.85", edgecolor="none")
        for r in range(n):
            for j in range(cols):
                if np.isnan(vals[r, j]) or j in pad:
                    continue
                changed = prev is not None and vals[r, j] != before[r, j]
                ax.text(j, r, f"{vals[r, j]:.2f}", ha="center", va="center", fontsize=7,
                        fontweight="bold" if changed else "normal")
                if changed:
                    ax.add_patch(
                        plt.Rectangle(
                            (j - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=1.2
                        )
                    )
        for x, kind in _boundaries(steps):
            ax.axvline(x - 0.5, color="black", linewidth=2.2 if kind == "bucket" else 1.2,
                       linestyle="-" if kind == "bucket" else "--")
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=8)
        ax.set_yticks(np.arange(n + 1) - 0.5, minor=True)
        ax.grid(which="minor", axis="y", color="white", linewidth=2)
        ax.tick_params(which="minor", length=0)
        ax.set_xticks([])
        ax.set_xlim(-0.5, cols - 0.5)
        ax.set_title(name, fontsize=9, loc="left")
    top = axes[0, 0]
    for name, start, numel in steps["segments"]:
        top.annotate(
            name,
            (start + numel / 2 - 0.5, -0.5),
            xytext=(0, 14),
            textcoords="offset points",
            ha="center",
            fontsize=8,
            color="0.3",
            annotation_clip=False,
        )
    cfg = steps["config"]
    what = (
        STAGE_NAMES[cfg["stage"]]
        + (", optimizer offloaded" if cfg["offload"] else "")
        + (", activation checkpointing" if cfg["checkpointing"] else "")
        + (
            f", shard groups of {cfg['shard_group_size']} ranks"
            if cfg.get("shard_group_size")
            else ""
        )
        + (f", hpZ groups of {cfg['hpz_group_size']} ranks" if cfg.get("hpz_group_size") else "")
        + (", per-parameter shards (fully_shard)" if cfg.get("layout") == "per-parameter" else "")
    )
    saved = ("" if ph["activations"][0] is None else     # (fully_shard's recorder: not counted)
             "\nsaved for backward per rank: " + ", ".join(f"{a} B" for a in ph["activations"]))
    fig.suptitle(f"{what}, N = {n}: phase {phase} of {len(phases) - 1}\n{ph['label']}{saved}",
                 fontsize=10)
    fig.subplots_adjust(
        left=1.1 / fig.get_figwidth(),
        right=0.99,
        top=1 - 1.45 / fig.get_figheight(),
        bottom=0.1 / fig.get_figheight(),
        hspace=0.5,
    )
    return fig


def stepper(first, compute, draw, count, choices: dict, key: tuple, play_ms: int = 2000,
            caption=None):
    """An ipywidgets control, returned for the cell to show: a Dropdown per entry of `choices`
    (name -> options, `key` the setting of `first`; a new setting calls compute(**setting), cached),
    a Play button and a slider over draw(result, i) for i < count(result); below each figure
    caption(result, i), if given and not None (the code that produced it)."""
    import ipywidgets as w
    from IPython.display import display
    cache, current = {key: first}, {"result": first}
    drops = {name: w.Dropdown(options=opts, value=value, description=name)
             for (name, opts), value in zip(choices.items(), key)}
    play = w.Play(interval=play_ms, max=count(first) - 1, description="play")
    slider = w.IntSlider(min=0, max=count(first) - 1, value=0, description="phase")
    w.jslink((play, "value"), (slider, "value"))
    out = w.Output()

    def show(*_):
        with out:
            out.clear_output(wait=True)
            fig = draw(current["result"], slider.value)
            display(fig)
            plt.close(fig)
            shown = caption(current["result"], slider.value) if caption else None
            if shown is not None:
                display(shown)

    def choose(*_):
        setting = tuple(d.value for d in drops.values())
        if setting not in cache:
            try:
                cache[setting] = compute(**dict(zip(drops, setting)))
            except (ValueError, RuntimeError) as exc:   # a setting the engine refuses: its one line
                with out:
                    out.clear_output()
                    print(f"{exc}".splitlines()[0])
                return
        current["result"] = cache[setting]
        last = count(current["result"]) - 1
        slider.value = min(slider.value, last)
        slider.max = play.max = last
        show()

    for d in drops.values():
        d.observe(choose, names="value")
    slider.observe(show, names="value")
    show()
    return w.VBox([w.HBox(list(drops.values())), w.HBox([play, slider]), out])


def step_widget(steps: dict, **choices):
    """The step-through, interactive: Play or drag over the phases; each Dropdown (a StepConfig
    field -> its options, e.g. stage=[0, 1, 2, 3], world_size=[2, 3, 4]) records the step again with
    that setting (one launch, ~1 s; cached). Below each phase: the function of minizero that
    produced it, its line marked."""
    from minizero.lab.stepthrough import StepConfig, record
    cfg = steps["config"]

    def code(s, k):
        phase = s["phases"][k]
        return phase_code(phase["source"], f"phase {k} ran {_ran(phase['source'])[5:]}")

    return stepper(steps, lambda **setting: record(StepConfig(**{**cfg, **setting})), step_grid,
                   lambda s: len(s["phases"]), choices, tuple(cfg[name] for name in choices),
                   caption=code)


def ring_table(ring: dict) -> str:
    """The ring all-reduce as text: each rank's padded buffer before each exchange and at the end,
    and which chunk it sends to its right neighbour."""
    n, c = ring["world_size"], ring["chunk"]
    lines = []
    for s, state in enumerate(ring["states"]):
        if s < len(ring["sends"]):
            phase = "reduce-scatter: the received chunk is added" if s < n - 1 else \
                "all-gather: the received chunk replaces the local one"
            lines.append(f"exchange {s + 1} of {2 * (n - 1)} ({phase})")
        else:
            lines.append("result: the sum on every rank")
        for r, row in enumerate(state):
            chunks = " |".join(
                "".join(f"{v:6.0f}" for v in row[i * c : (i + 1) * c]) for i in range(n)
            )
            sends = (
                f"   sends chunk {ring['sends'][s][r]} to rank {(r + 1) % n}"
                if s < len(ring["sends"])
                else ""
            )
            lines.append(f"    rank {r}:{chunks}{sends}")
    return "\n".join(lines)


def ring_grid(ring: dict, s: int):
    """State s of the ring all-reduce (0: the inputs; 2(N-1): the sums): one row per rank, chunks
    between the dashed lines, padding hatched; green: the chunk the last exchange wrote, orange
    frame: the chunk the rank sends next to its right neighbour."""
    n, c, numel = ring["world_size"], ring["chunk"], ring["numel"]
    vals = _cells(ring["states"][s])
    fig, ax = plt.subplots(figsize=(0.75 * n * c + 3.2, 0.5 * n + 1.4))
    ax.imshow(np.zeros_like(vals), cmap="Greys", vmin=0, vmax=1, aspect="auto")
    for r in range(n):
        if s > 0:                                            # written by the last exchange
            i = ring["sends"][s - 1][(r - 1) % n]
            ax.add_patch(
                plt.Rectangle((i * c - 0.5, r - 0.5), c, 1, facecolor="tab:green", alpha=0.35)
            )
        if s < len(ring["sends"]):                           # sent next
            i = ring["sends"][s][r]
            ax.add_patch(
                plt.Rectangle(
                    (i * c - 0.5, r - 0.45),
                    c,
                    0.9,
                    fill=False,
                    edgecolor="tab:orange",
                    linewidth=2.5,
                )
            )
            ax.annotate(f"chunk {i} → rank {(r + 1) % n}", (n * c - 0.5, r), xytext=(8, 0),
                        textcoords="offset points", va="center", fontsize=8, color="tab:orange",
                        annotation_clip=False)
        for j in range(n * c):
            if j >= numel:
                ax.add_patch(plt.Rectangle((j - 0.5, r - 0.5), 1, 1, facecolor="0.88", hatch="///",
                                           edgecolor="0.65", linewidth=0))
            else:
                ax.text(j, r, f"{vals[r, j]:.0f}", ha="center", va="center", fontsize=9)
    for i in range(1, n):
        ax.axvline(i * c - 0.5, color="black", linestyle="--", linewidth=1.2)
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_yticks(np.arange(n + 1) - 0.5, minor=True)
    ax.grid(which="minor", axis="y", color="white", linewidth=2)
    ax.tick_params(which="minor", length=0)
    ax.set_xticks([i * c + (c - 1) / 2 for i in range(n)], [f"chunk {i}" for i in range(n)])
    steps = len(ring["sends"])
    if s == 0:
        what = "the inputs (rank r: 10 r + 1, 2, ...)"
    elif s <= n - 1:
        what = f"after exchange {s} of {steps}: reduce-scatter, the received chunk was added"
    else:
        what = (
            f"after exchange {s} of {steps}: all-gather, the received chunk replaced the local one"
        )
    ax.set_title(
        f"ring all-reduce, N = {n}: {what}" + (" (done: the sum everywhere)" if s == steps else ""),
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def ring_widget(ring: dict, world_sizes=(2, 3, 4)):
    """The ring, interactive: Play or drag over the 2(N-1) exchanges; the Dropdown runs it on
    another N."""
    from minizero.lab.stepthrough import ring as run_ring

    def code(rg, s):                # the exchange that comes next, in ring.py's ring_all_reduce
        if s >= len(rg["sources"]):
            return None
        return phase_code(rg["sources"][s], f"exchange {s + 1} runs {_ran(rg['sources'][s])[5:]}")

    return stepper(ring, lambda world_size: run_ring(world_size, ring["numel"]), ring_grid,
                   lambda rg: len(rg["states"]), {"world_size": list(world_sizes)},
                   (ring["world_size"],), caption=code)
