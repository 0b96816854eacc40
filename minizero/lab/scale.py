"""How big a model fits? For a per-rank memory budget, the largest GPT each stage can train
at N ranks, and (--micro-batch) the largest micro-batch a fixed GPT can train, with and
without checkpointing.

    python -m minizero.scale --budget-mb 4                       # N = 1, 2, 4
    python -m minizero.scale --budget-mb 4 --world-size 1 2 4 8 --json scale.json
    python -m minizero.bench --scale --budget-mb 4               # the same
    # rows per rank, see below
    python -m minizero.scale --micro-batch --budget-mb 8 [--model default]
    python -m minizero.scale --rss [--rss-cap-mb 200]     # real memory under a real cap: lab/rss.py
    python -m minizero.scale --infinity [--layers 48]     # 1.5B on disk: lab/infinity.py

The model grows in width (n_embd, in steps of 4; n_layer stays 8), Ψ ≈ 12·n_layer·n_embd². A size
*fits* when building it, wrapping it and taking two real training steps keeps engine.memory()'s
device peak (parameters + gradients + optimizer state on the compute device, the most seen at any
moment: buckets in flight and gathered units included) within the budget on every rank. The
search doubles the width until a step no longer fits, then bisects: each probe is measured, none
is predicted.

What to expect (fp32 AdamW: 4 + 4 bytes per parameter and K = 8; the paper's formulas):
    DDP 16Ψ, stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N, stage 3 16Ψ/N (+ the units gathered right now),
    stage 3 + offload 8Ψ/N (+ units): the optimizer state lives on the host.
So at a fixed budget Ψ_max(stage 3) / Ψ_max(DDP) grows with N, towards 16 / (16/N + c): c is what is
in flight at the peak, in bytes per parameter: two gathered units (one computing, one prefetched)
plus a unit's full gradients and their staged copies, ~2.5 for 8 blocks (it shrinks as 1/n_layer).
Measured with 4 MB: 0.84, 1.55, 2.48 at N = 1, 2, 4; the formula without c would say 1, 2, 4.

--micro-batch turns the question around (ZeRO-R): the model is fixed (--model), and what grows is
the micro-batch, the rows of block_size tokens each rank computes per step. A micro-batch fits when
the device peak of model states *plus* the measured activations
(engine.memory()["peak"] + ["activations"], two real steps) stays within the budget on every rank.
Next to it, the estimate: the largest micro-batch for which minizero.memory.estimate (the paper's
model states) +
activation_bytes (the saved-for-backward formula) fit. Activations grow with the rows, model states
do not: ZeRO-DP frees room for rows, and checkpointing makes each row cheaper (s·b·h kept per block
instead of ~(16h + a·s)·s·b). The activations are measured within TOLERANCE of their estimate; the
model states' formula leaves out what is in flight (stage 2's buckets, stage 3's gathered units), so
there the estimate promises more rows than fit. The default GPT in 8 MB, measured/estimated rows,
plain | ckpt: DDP 7/7 | 27/27 at N = 1, 2, 4; stage 3 6/7 | 22/27 at N = 1, 10/11 | 36/41 at N = 4.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minizero import comm
from minizero.lab.data import global_batch, local_batch, sequence_length
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import TrainConfig, loss_fn, progress_bar
from minizero.launcher import launch
from minizero.memory import activation_bytes, estimate
from minizero.wrap import wrap

# (label, stage, offload)
VARIANTS = (("DDP", 0, False), ("stage 1", 1, False), ("stage 2", 2, False), ("stage 3", 3, False),
            ("stage 3 + offload", 3, True))
WIDTH_STEP = 4                     # n_embd grows in multiples of 4 (its 4 heads)
N_LAYER = 8                        # stage 3's units are blocks: more of them, less gathered at once
BUCKETS = 8                        # gradient buckets per model (stages 0, 2), see probe()
# --micro-batch: each variant without, then with activation checkpointing
CHECKPOINTING = (False, True)
# --micro-batch stops doubling here: a CPU demo, not a stress test
MAX_ROWS = 512
# measured activations vs activation_bytes (tests/test_activations.py)
TOLERANCE = 0.10


def model_config(width: int) -> GPTConfig:
    return GPTConfig(n_layer=N_LAYER, n_embd=width)


def probe(
    stage: int, offload: bool, mcfg: GPTConfig, rows: int = 2, checkpointing: bool = False
) -> dict:
    """Collective: build this GPT, wrap it, take two AdamW steps on `rows` rows per rank; this
    rank's memory (model states and activations) and Ψ.

    Buckets are 1/BUCKETS of the model, as in real training where a 25 MB bucket is a sliver of the
    model: with one bucket for the whole model, stage 2 would hold every full gradient and its
    staged copy at once and lose its saving."""
    cfg = TrainConfig(stage=stage, offload=offload)
    model = make_model(mcfg)
    bucket_bytes = 4 * model.num_params() / BUCKETS
    options = {"bucket_size": bucket_bytes} if stage in (0, 2) else {}
    engine = wrap(
        model,
        stage,
        cfg.optimizer_factory(),
        offload=offload,
        activation_checkpointing=checkpointing,
        **options,
    )
    n = comm.world_size()
    # Two steps: the optimizer creates its state lazily in the first, so only the second backward
    # shows the peak of a long run (state + full units + gradients in flight at once).
    for step in range(2):
        x, y = local_batch(*global_batch(step, rows * n, mcfg.block_size), comm.rank(), n)
        comm.reset_tally()
        engine.backward(loss_fn(engine(x.to(engine.device)), y.to(engine.device)))
        engine.step()
    return {
        "width": mcfg.n_embd,
        "rows": rows,
        "checkpointing": checkpointing,
        "num_params": model.num_params(),
        "memory": engine.memory(),
        "comm_bytes_per_step": comm.tally()["total"],
    }


def probe_worker(width: int, variants=VARIANTS) -> list[dict]:
    """Worker: one probe per variant at one width (what slides/make_figures.py plots)."""
    torch.set_num_threads(1)
    return [
        {"variant": label, **probe(stage, offload, model_config(width))}
        for label, stage, offload in variants
    ]


def largest(fits: Callable[[int], tuple[bool, dict]], limit: int | None = None,
            guess: int | None = None) -> tuple[int, dict | None, int]:
    """The largest k >= 1 with fits(k) (0: not even 1), its record and the number of probes, for a
    `fits` that is monotone (true up to some k, false beyond) and k <= `limit`. Every search here,
    measured or estimated, is this one: widths in steps of WIDTH_STEP, micro-batches in rows.

    First bracket the answer, then bisect between the last fit and the first miss. Without a guess
    the bracket doubles k from 1 (1, 2, 4, ...: log2 of the answer probes). With a guess (an
    estimate, when one is at hand) it starts there and walks away from it, 1, 2, 4, ... steps at a
    time, in the direction the first probe says: a close guess costs two or three probes, a poor one
    still log2."""
    # lo fits (0: nothing yet), hi does not (None: not found)
    lo, hi, best, probes = 0, None, None, 0
    k, step = max(guess or 1, 1), 1
    while True:                                     # bracket
        if limit is not None:
            k = min(k, limit)
        ok, record = fits(k)
        probes += 1
        if ok:
            lo, best = k, record
            if hi is not None or k == limit:   # a miss above is known (or nothing above is allowed)
                break
            k = 2 * k if guess is None else k + step
        else:
            hi = k
            if lo or k == 1:                        # a fit below is known (or k = 1 already misses)
                break
            k = max(k - step, 1)
        step *= 2
    while hi is not None and hi - lo > 1:        # bisection between the last fit and the first miss
        mid = (lo + hi) // 2
        ok, record = fits(mid)
        probes += 1
        if ok:
            lo, best = mid, record
        else:
            hi = mid
    return lo, best, probes


def _fits(budget: float, stage: int, offload: bool, mcfg: GPTConfig, rows: int = 2,
          checkpointing: bool = False, with_activations: bool = False) -> tuple[bool, dict]:
    """All ranks agree: the largest peak over ranks decides (a rank over budget would run out). The
    peak is the model states' (engine.memory()["peak"]), plus the step's activations if
    `with_activations`. Model states peak in backward and step, activations at the end of forward:
    adding the two peaks is what a planner does with a budget, an upper bound on what is resident
    at once."""
    record = probe(stage, offload, mcfg, rows, checkpointing)
    mem = record["memory"]
    record["total"] = mem["peak"] + (mem["activations"] if with_activations else 0)
    worst = torch.tensor([float(record["total"])], device=comm.device())
    comm.all_reduce(worst, op="max")
    return worst.item() <= budget, record


def largest_worker(budget: float, variants=VARIANTS) -> list[dict]:
    """Worker: per variant, the widest model whose measured peak fits `budget` bytes (None: not even
    the narrowest), over widths that are multiples of WIDTH_STEP."""
    torch.set_num_threads(1)
    out = []
    for label, stage, offload in variants:
        _, best, probes = largest(
            lambda k: _fits(budget, stage, offload, model_config(k * WIDTH_STEP))
        )
        out.append({"variant": label, "stage": stage, "offload": offload, "probes": probes,
                    "largest": best})
    return out


def estimated_total(
    mcfg: GPTConfig,
    num_params: int,
    world_size: int,
    stage: int,
    offload: bool,
    rows: int,
    checkpointing: bool,
) -> float:
    """The paper's device model states (fp32 AdamW: 4 + 4 bytes per parameter, K = 8) plus the
    activations minizero.memory.activation_bytes predicts for `rows` rows of this GPT."""
    states = estimate(
        num_params, world_size, stage, param_bytes=4, grad_bytes=4, k=8, offload=offload
    )
    seq = sequence_length(mcfg.block_size)
    return states + activation_bytes(
        mcfg.n_layer, mcfg.n_embd, mcfg.n_head, seq, rows,
        mlp_ratio=mcfg.mlp_ratio,
        checkpointing=checkpointing,
    )


def micro_batch_worker(budget: float, model: str = "default", variants=VARIANTS,
                       modes=CHECKPOINTING) -> list[dict]:
    """Worker: per variant and checkpointing mode, the largest micro-batch (rows per rank) of
    the GPT `model` whose measured model states + activations fit `budget` bytes, and the
    estimated one."""
    torch.set_num_threads(1)
    mcfg = GPTConfig.named(model)
    num_params = make_model(mcfg).num_params()
    n = comm.world_size()
    out = []
    for label, stage, offload in variants:
        for ckpt in modes:
            # The estimate first (arithmetic), then the measured search starts from it: the
            # estimate is close (it leaves out only what is in flight), so each measured search
            # takes a few probes.
            est_rows, _, _ = largest(
                lambda b: (
                    estimated_total(mcfg, num_params, n, stage, offload, b, ckpt) <= budget,
                    {},
                ),
                MAX_ROWS,
            )
            rows, best, probes = largest(
                lambda b: _fits(budget, stage, offload, mcfg, b, ckpt, True),
                MAX_ROWS,
                guess=est_rows,
            )
            out.append({"variant": label, "stage": stage, "offload": offload, "checkpointing": ckpt,
                        "probes": probes, "rows": rows, "estimated_rows": est_rows, "largest": best,
                        "estimated_total": estimated_total(
                            mcfg, num_params, n, stage, offload, rows, ckpt
                        )
                        if rows
                        else None})
    return out


def largest_models(budget_mb: float, world_sizes=(1, 2, 4), progress: bool = False) -> dict:
    """{"budget_bytes", "world_sizes", "rows": [{variant, stage, offload, world_size, width,
    num_params, peak}], "stage3_over_ddp": {N: Ψ_max ratio}}: one launch per world size, rank
    0's records."""
    budget = budget_mb * 1e6
    per_n = {n: launch(largest_worker, n, budget, backend="gloo")[0]
             for n in _each(world_sizes, progress)}
    return report(budget, per_n)


def _each(world_sizes, progress: bool):
    """The world sizes, one launch each, with a progress bar (time left) when someone watches."""
    bar = progress_bar(len(world_sizes), "world sizes", progress, unit="N")
    for n in world_sizes:
        bar.set_postfix(N=n)
        yield n
        bar.update()
    bar.close()


def report(budget: float, per_n: dict[int, list[dict]]) -> dict:
    """The table behind largest_models, from rank 0's largest_worker records at each N."""
    rows = []
    for n, records in per_n.items():
        for rec in records:
            best = rec["largest"]
            rows.append(
                {
                    "variant": rec["variant"],
                    "stage": rec["stage"],
                    "offload": rec["offload"],
                    "world_size": n,
                    "probes": rec["probes"],
                    "width": best["width"] if best else None,
                    "num_params": best["num_params"] if best else 0,
                    "peak": best["memory"]["peak"] if best else None,
                }
            )
    psi = {(r["variant"], r["world_size"]): r["num_params"] for r in rows}
    ratio = {n: psi[("stage 3", n)] / psi[("DDP", n)] if psi[("DDP", n)] else None for n in per_n}
    return {"budget_bytes": budget, "world_sizes": list(per_n), "n_layer": N_LAYER, "rows": rows,
            "stage3_over_ddp": ratio}


def largest_micro_batches(budget_mb: float, world_sizes=(1, 2, 4), model: str = "default",
                          progress: bool = False) -> dict:
    """{"mode": "micro_batch", "budget_bytes", "world_sizes", "model", "num_params", "seq", "rows":
    [{variant, stage, offload, checkpointing, world_size, probes, micro_batch,
    estimated_micro_batch, capped, peak, activations, total, estimated_total}]}: one launch per
    world size, rank 0's records."""
    budget = budget_mb * 1e6
    mcfg = GPTConfig.named(model)
    rows = []
    for n in _each(world_sizes, progress):
        for rec in launch(micro_batch_worker, n, budget, model, backend="gloo")[0]:
            best = rec["largest"]
            rows.append(
                {
                    "variant": rec["variant"],
                    "stage": rec["stage"],
                    "offload": rec["offload"],
                    "checkpointing": rec["checkpointing"],
                    "world_size": n,
                    "probes": rec["probes"],
                    "micro_batch": rec["rows"],
                    "estimated_micro_batch": rec["estimated_rows"],
                    "capped": rec["rows"] >= MAX_ROWS,
                    "num_params": best["num_params"] if best else None,
                    "peak": best["memory"]["peak"] if best else None,
                    "activations": best["memory"]["activations"] if best else None,
                    "total": best["total"] if best else None,
                    "estimated_total": rec["estimated_total"],
                }
            )
    return {
        "mode": "micro_batch",
        "budget_bytes": budget,
        "world_sizes": list(world_sizes),
        "model": model,
        "seq": sequence_length(mcfg.block_size),
        "max_rows": MAX_ROWS,
        "rows": rows,
    }


def format_table(report: dict) -> str:
    if report.get("mode") == "micro_batch":
        return format_micro_batch_table(report)
    ns = report["world_sizes"]
    lines = [f"largest GPT (n_layer {report['n_layer']}, width n_embd) that trains within "
             f"{report['budget_bytes'] / 1e6:g} MB of device model states per rank; fp32 AdamW",
             f"{'':20}" + "".join(f"{f'N = {n}':>22}" for n in ns)]
    for label, _, _ in VARIANTS:
        cells = []
        for n in ns:
            r = next(r for r in report["rows"] if r["variant"] == label and r["world_size"] == n)
            cells.append(
                f"{r['num_params']:>12,} (w {r['width']:>4})" if r["width"] else f"{'none':>22}"
            )
        lines.append(f"{label:20}" + "".join(f"{c:>22}" for c in cells))
    ratios = "   ".join(
        f"N = {n}: {v:.2f}" if v else f"N = {n}: -" for n, v in report["stage3_over_ddp"].items()
    )
    lines.append(f"Ψ_max(stage 3) / Ψ_max(DDP):   {ratios}   (ZeRO's promise: -> N)")
    return "\n".join(lines)


def format_micro_batch_table(report: dict) -> str:
    """Per variant (lines) and N (columns): measured/estimated largest micro-batch, plain
    then checkpointed."""
    ns = report["world_sizes"]
    cell = lambda r: f"{r['micro_batch']}{'+' if r['capped'] else ''}/{r['estimated_micro_batch']}"  # noqa: E731
    lines = [
        f"largest micro-batch (rows of {report['seq']} "
        f"tokens per rank) of the {report['model']} GPT that "
        f"trains within {report['budget_bytes'] / 1e6:g} "
        "MB per rank: device model states + activations, "
        "fp32 AdamW",
        "measured/estimated rows (estimate: memory.estimate + memory.activation_bytes)"
        + (
            f"; + : stopped at {report['max_rows']}"
            if any(r["capped"] for r in report["rows"])
            else ""
        ),
        f"{'':20}" + "".join(f"{f'N = {n}':>22}" for n in ns),
        f"{'':20}" + "".join(f"{'plain |  ckpt':>22}" for n in ns),
    ]
    for label, _, _ in VARIANTS:
        cells = []
        for n in ns:
            plain, ckpt = (
                next(
                    r
                    for r in report["rows"]
                    if r["variant"] == label and r["world_size"] == n and r["checkpointing"] == c
                )
                for c in CHECKPOINTING
            )
            cells.append(f"{cell(plain):>9} | {cell(ckpt):>5}")
        lines.append(f"{label:20}" + "".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)
