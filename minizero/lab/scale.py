"""How big a model fits? For a per-rank memory budget, the largest GPT each stage can train at N ranks.

    python -m minizero.scale --budget-mb 4                       # N = 1, 2, 4
    python -m minizero.scale --budget-mb 4 --world-size 1 2 4 8 --json scale.json
    python -m minizero.bench --scale --budget-mb 4               # the same

The model grows in width (n_embd, in steps of 4; n_layer stays 8), Ψ ≈ 12·n_layer·n_embd². A size
*fits* when building it, wrapping it and taking two real training steps keeps engine.memory()'s device
peak (parameters + gradients + optimizer state on the compute device, the most seen at any moment:
buckets in flight and gathered units included) within the budget on every rank. The search doubles the
width until a step no longer fits, then bisects: each probe is measured, none is predicted.

What to expect (fp32 AdamW: 4 + 4 bytes per parameter and K = 8; the paper's formulas):
    DDP 16Ψ, stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N, stage 3 16Ψ/N (+ the units gathered right now),
    stage 3 + offload 8Ψ/N (+ units): the optimizer state lives on the host.
So at a fixed budget Ψ_max(stage 3) / Ψ_max(DDP) grows with N, towards 16 / (16/N + c): c is what is
in flight at the peak, in bytes per parameter: two gathered units (one computing, one prefetched) plus a
unit's full gradients and their staged copies, ~2.5 for 8 blocks (it shrinks as 1/n_layer). Measured
with 4 MB: 0.84, 1.55, 2.48 at N = 1, 2, 4; the formula without c would say 1, 2, 4.
"""

from __future__ import annotations

import sys

import torch

from minizero import comm
from minizero.cli import OneLineParser, UsageError, emit, fail
from minizero.lab.data import global_batch, local_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import TrainConfig, loss_fn
from minizero.launcher import launch
from minizero.wrap import wrap

# (label, stage, offload)
VARIANTS = (("DDP", 0, False), ("stage 1", 1, False), ("stage 2", 2, False), ("stage 3", 3, False),
            ("stage 3 + offload", 3, True))
WIDTH_STEP = 4                      # n_embd grows in multiples of 4 (its 4 heads)
N_LAYER = 8                         # stage 3's units are blocks: more of them, less gathered at once
BUCKETS = 8                         # gradient buckets per model (stages 0, 2), see probe()


def model_config(width: int) -> GPTConfig:
    return GPTConfig(n_layer=N_LAYER, n_embd=width)


def probe(stage: int, offload: bool, width: int) -> dict:
    """Collective: build the GPT of this width, wrap it, take two AdamW steps; this rank's memory and Ψ.

    Buckets are 1/BUCKETS of the model, as in real training where a 25 MB bucket is a sliver of the
    model: with one bucket for the whole model, stage 2 would hold every full gradient and its staged
    copy at once and lose its saving."""
    cfg = TrainConfig(stage=stage, offload=offload)
    mcfg = model_config(width)
    model = make_model(mcfg)
    bucket_bytes = 4 * model.num_params() / BUCKETS
    options = {"bucket_size": bucket_bytes} if stage in (0, 2) else {}
    engine = wrap(model, stage, cfg.optimizer_factory(), offload=offload, **options)
    n = comm.world_size()
    # Two steps: the optimizer creates its state lazily in the first, so only the second backward shows
    # the peak of a long run (state + full units + gradients in flight at once).
    for step in range(2):
        x, y = local_batch(*global_batch(step, 2 * n, mcfg.block_size), comm.rank(), n)
        comm.reset_tally()
        engine.backward(loss_fn(engine(x.to(engine.device)), y.to(engine.device)))
        engine.step()
    return {"width": width, "num_params": model.num_params(), "memory": engine.memory(),
            "comm_bytes_per_step": comm.tally()["total"]}


def probe_worker(width: int, variants=VARIANTS) -> list[dict]:
    """Worker: one probe per variant at one width (what slides/make_figures.py plots)."""
    torch.set_num_threads(1)
    return [{"variant": label, **probe(stage, offload, width)} for label, stage, offload in variants]


def _fits(stage: int, offload: bool, width: int, budget: float) -> tuple[bool, dict]:
    """All ranks agree: the largest peak over ranks decides (a rank over budget would run out)."""
    record = probe(stage, offload, width)
    worst = torch.tensor([float(record["memory"]["peak"])], device=comm.device())
    comm.all_reduce(worst, op="max")
    return worst.item() <= budget, record


def largest_worker(budget: float, variants=VARIANTS) -> list[dict]:
    """Worker: per variant, the widest model whose measured peak fits `budget` bytes (None: not even the
    narrowest), found by doubling then bisecting over widths that are multiples of WIDTH_STEP."""
    torch.set_num_threads(1)
    out = []
    for label, stage, offload in variants:
        best, probes = None, 0
        lo, hi = 0, 1                               # in units of WIDTH_STEP: lo fits (0: nothing), hi does not
        while True:                                 # doubling: find a width that does not fit
            ok, record = _fits(stage, offload, hi * WIDTH_STEP, budget)
            probes += 1
            if not ok:
                break
            lo, best, hi = hi, record, hi * 2
        while hi - lo > 1:                          # bisection between the last fit and the first miss
            mid = (lo + hi) // 2
            ok, record = _fits(stage, offload, mid * WIDTH_STEP, budget)
            probes += 1
            if ok:
                lo, best = mid, record
            else:
                hi = mid
        out.append({"variant": label, "stage": stage, "offload": offload, "probes": probes,
                    "largest": best})
    return out


def largest_models(budget_mb: float, world_sizes=(1, 2, 4)) -> dict:
    """{"budget_bytes", "world_sizes", "rows": [{variant, stage, offload, world_size, width, num_params,
    peak}], "stage3_over_ddp": {N: Ψ_max ratio}}: one launch per world size, rank 0's records."""
    budget = budget_mb * 1e6
    per_n = {n: launch(largest_worker, n, budget, backend="gloo")[0] for n in world_sizes}
    return report(budget, per_n)


def report(budget: float, per_n: dict[int, list[dict]]) -> dict:
    """The table behind largest_models, from rank 0's largest_worker records at each N."""
    rows = []
    for n, records in per_n.items():
        for rec in records:
            best = rec["largest"]
            rows.append({"variant": rec["variant"], "stage": rec["stage"], "offload": rec["offload"],
                         "world_size": n, "probes": rec["probes"],
                         "width": best["width"] if best else None,
                         "num_params": best["num_params"] if best else 0,
                         "peak": best["memory"]["peak"] if best else None})
    psi = {(r["variant"], r["world_size"]): r["num_params"] for r in rows}
    ratio = {n: psi[("stage 3", n)] / psi[("DDP", n)] if psi[("DDP", n)] else None for n in per_n}
    return {"budget_bytes": budget, "world_sizes": list(per_n), "n_layer": N_LAYER, "rows": rows,
            "stage3_over_ddp": ratio}


def format_table(report: dict) -> str:
    ns = report["world_sizes"]
    lines = [f"largest GPT (n_layer {report['n_layer']}, width n_embd) that trains within "
             f"{report['budget_bytes'] / 1e6:g} MB of device model states per rank; fp32 AdamW",
             f"{'':20}" + "".join(f"{f'N = {n}':>22}" for n in ns)]
    for label, _, _ in VARIANTS:
        cells = []
        for n in ns:
            r = next(r for r in report["rows"] if r["variant"] == label and r["world_size"] == n)
            cells.append(f"{r['num_params']:>12,} (w {r['width']:>4})" if r["width"] else f"{'none':>22}")
        lines.append(f"{label:20}" + "".join(f"{c:>22}" for c in cells))
    ratios = "   ".join(f"N = {n}: {v:.2f}" if v else f"N = {n}: -" for n, v in report["stage3_over_ddp"].items())
    lines.append(f"Ψ_max(stage 3) / Ψ_max(DDP):   {ratios}   (ZeRO's promise: -> N)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    prog = "python -m minizero.scale"
    ap = OneLineParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--budget-mb", type=float, default=4.0, help="per-rank device budget in MB (default 4)")
    ap.add_argument("--world-size", type=int, nargs="+", default=[1, 2, 4], help="N values (default 1 2 4)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    try:
        args = ap.parse_args(argv)
        if not args.budget_mb > 0:
            raise UsageError(f"--budget-mb must be > 0, got {args.budget_mb}")
        if args.budget_mb > 1000:
            raise UsageError("--budget-mb above 1000 would train models too big for a quick CPU demo")
        if any(n < 1 for n in args.world_size):
            raise UsageError("--world-size: every N must be >= 1")
    except UsageError as e:
        return fail(prog, str(e))
    try:
        report = largest_models(args.budget_mb, tuple(args.world_size))
    except RuntimeError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    emit(format_table(report), report, args.json)
    return 0
