"""The measurements behind slides/make_figures.py, as one worker per world size (launches are the
slow part of a small run: one process group does everything at each N); and the bench's figure,
drawn the same way in notebook 06 and in the slides.

    from minizero.lab.figures import survey, bench_ratios
    data = survey(world_sizes=(1, 2, 4), width=64, budget_mb=4.0)
    bench_ratios(minizero.lab.bench.compare((2,), sizes=("1M", "8M")))    # ratio vs size, per stage

At every N: each variant of minizero.scale.VARIANTS probed at one width (memory after two steps,
bytes sent in the second), the largest width each trains within the budget (minizero.scale), and at
N = 2 one stage-3 step's gather/free timeline with and without prefetch (minizero.lab.demo).
"""

from __future__ import annotations

from minizero.lab.demo import zero3_timeline_worker
from minizero.lab.scale import largest_worker, probe_worker, report
from minizero.lab.train import TrainConfig
from minizero.launcher import launch

TIMELINE_N = 2


def survey_worker(width: int, budget: float, timeline_model: str | None) -> dict:
    out = {"probes": probe_worker(width), "largest": largest_worker(budget)}
    if timeline_model:
        cfgs = [
            TrainConfig(stage=3, model=timeline_model, batch_size=24, prefetch=p)
            for p in (False, True)
        ]
        out["timeline"] = {str(rec["prefetch"]): rec for rec in zero3_timeline_worker(cfgs)}
    return out


def survey(world_sizes=(1, 2, 4), *, width: int = 64, budget_mb: float = 4.0,
           timeline_model: str = "default") -> dict:
    """{"world_sizes", "probes": {N: [record per variant]}, "scale": minizero.lab.scale.report(...),
    "timeline": {"False"|"True": record}} (rank 0's records)."""
    if TIMELINE_N not in world_sizes:
        raise ValueError(f"world_sizes must include {TIMELINE_N} (the stage-3 timeline runs there)")
    budget = budget_mb * 1e6
    per_n = {n: launch(survey_worker, n, width, budget, timeline_model if n == TIMELINE_N else None,
                       backend="gloo")[0] for n in world_sizes}
    return {"world_sizes": list(world_sizes), "probes": {n: r["probes"] for n, r in per_n.items()},
            "scale": report(budget, {n: r["largest"] for n, r in per_n.items()}),
            "timeline": per_n[TIMELINE_N]["timeline"]}


def bench_ratios(report: dict):
    """minizero.bench's step-time ratios (minizero / peer) against Ψ: one panel per stage, one line
    per peer (a line style per N) through the ratio of the medians, and a small dot for the ratio
    within each repeat: on shared cores the repeats often straddle 1. Below the grey line at 1.0
    minizero is faster. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter
    pairs = report["pairs"]
    variants = list(dict.fromkeys(p["variant"] for p in pairs))
    world_sizes = sorted({p["world_size"] for p in pairs})
    fig, axes = plt.subplots(
        1, len(variants), figsize=(2.6 * len(variants) + 1, 3.4), sharey=True, squeeze=False
    )
    for ax, variant in zip(axes[0], variants):
        here = [p for p in pairs if p["variant"] == variant]
        for peer in dict.fromkeys(p["peer"] for p in here):
            color = "tab:red" if peer == "deepspeed" else "tab:blue"
            for n, style in zip(world_sizes, ("o-", "s--", "^:", "d-.")):
                points = sorted(
                    (p["num_params"], p["ratio"])
                    for p in here
                    if p["peer"] == peer and p["world_size"] == n
                )
                if points:
                    ax.plot(*zip(*points), style, color=color, label=f"{peer}, N = {n}")
                repeats = [
                    (p["num_params"], r)
                    for p in here
                    if p["peer"] == peer and p["world_size"] == n
                    for r in p["repeat_ratios"]
                ]
                if repeats:
                    ax.plot(*zip(*repeats), ".", color=color, alpha=0.5, markersize=4)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        sizes = sorted({p["num_params"] for p in here})
        # the sizes measured, nothing between
        ax.set_xticks(sizes, [f"{psi / 1e6:.2g}M" for psi in sizes])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set(title=f"stage {variant}", xlabel="Ψ (parameters)")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("step time minizero / peer")
    fig.suptitle(
        "minizero against PyTorch's and DeepSpeed's ZeRO (median step time; dots: each repeat; "
        "< 1: minizero faster)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig
