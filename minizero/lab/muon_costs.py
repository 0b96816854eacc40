"""What each Muon design costs a rank, measured next to its formula, at N = 2, 3, 4.

    python -m minizero.bench --muon --costs                    # the table of docs/muon.md
    python -m minizero.bench --muon --costs --world-size 3 --size 8M

For each world size N, stage and design (minizero/beyond/muon/: (a) straddle, (b) whole, (c)
round_robin), the GPT of `size` trains a few steps with the usual split (Muon for the blocks'
matrices, AdamW for the embeddings, the tied head, norms and biases) and every rank reports:
  * Muon's own bytes sent per step: measured (comm.py's ring tally of the collectives tagged
    "Muon", from the event stream) and the design's formula (Design.sent_bytes), which must agree;
    and the step's total (ZeRO's own collectives too), next to the same run with AdamW alone;
  * the momentum's bytes: measured (the optimizer's state) and the formula (4 bytes per element of
    the matrices' pieces this rank holds), and the most any rank holds (balance);
  * Newton-Schulz: how many matrices this rank orthogonalizes and their GFLOP (modelled: 5 steps of
    4·m²·n + 2·m³ for m <= n), the most any rank does (balance), and the median time of the
    optimizer step (measured, a shared machine: noisy);
  * the largest transient buffer the design allocates in step() (modelled from the layout: (a) N·L
    bf16 for its longest straddler, (c) 2·Ψ_b bf16 for its largest bucket, U and O).
"""

from __future__ import annotations

import functools
import statistics

import torch

from minizero import comm, events
from minizero.beyond.muon.home import DESIGNS
from minizero.lab.data import global_batch, local_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import clock, loss_fn
from minizero.launcher import launch
from minizero.wrap import wrap

STAGE_DESIGNS = {1: ("straddle", "whole", "round_robin"), 2: ("straddle", "whole", "round_robin"),
                 3: ("straddle", "round_robin")}          # (b) needs a stage that picks buckets
LR, ADAMW_LR = 0.02, 3e-3


def usual_split(model) -> list[dict]:
    """Muon for the matrices inside the blocks, AdamW for the rest (torch's Muon docs' advice)."""
    hidden = [p for block in model.blocks for p in block.parameters() if p.ndim == 2]
    ids = {id(p) for p in hidden}
    return [{"params": hidden},
            {"params": [p for p in model.parameters() if id(p) not in ids], "use_muon": False,
             "lr": ADAMW_LR}]


def newton_schulz_gflop(shape, steps: int = 5) -> float:
    """One orthogonalization of a matrix of `shape` (update.newton_schulz: X·X^T, A·A, B·X)."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m ** 3) / 1e9


def _run(size: str, stage: int, design: str | None, steps: int, batch: int) -> dict:
    """One run on this rank: what the module docstring lists (design None: AdamW alone)."""
    model = make_model(GPTConfig.named(size), seed=0)
    if design is None:
        engine = wrap(model, stage, functools.partial(torch.optim.AdamW, lr=ADAMW_LR))
    else:
        engine = wrap(model, stage, functools.partial(torch.optim.Muon, lr=LR),
                      param_groups=usual_split(model), muon_design=design)
    sent = {"muon": 0.0}

    def count(name, fields):
        if name == "collective" and fields["tag"].startswith("Muon"):
            sent["muon"] += fields["sent"]
    step_times, optimizer_times = [], []
    with events.subscribed(count):
        for step in range(steps):
            comm.reset_tally()
            sent["muon"] = 0.0
            x, y = local_batch(*global_batch(step, batch, model.cfg.block_size), comm.rank(),
                               comm.world_size())
            start = clock()
            engine.backward(loss_fn(engine(x), y))
            stepping = clock()
            engine.step()
            step_times.append(clock() - start)
            optimizer_times.append(clock() - stepping)
    out = {"total": comm.tally()["total"], "step_s": statistics.median(step_times[1:]),
           "optimizer_s": statistics.median(optimizer_times[1:])}
    if design is None:
        return out
    layout = engine.optimizer.optimizer.design.layout
    orthogonalize = engine.optimizer.optimizer.design
    mine = [m for m in layout.matrices if _orthogonalizes(orthogonalize, layout, m)]
    state = engine.optimizer.optimizer.state.values()
    return {**out, "muon": sent["muon"], "muon_formula": orthogonalize.sent_bytes(),
            "momentum": sum(s["momentum_buffer"].numel() * 4 for s in state
                            if "momentum_buffer" in s),
            "momentum_formula": 4 * sum(p.numel for pieces in layout.pieces for p in pieces),
            "ns_calls": orthogonalize.newton_schulz_calls(),
            "ns_gflop": sum(newton_schulz_gflop(m.param.shape) for m in mine),
            "straddlers": sum(m.straddles for m in layout.matrices),
            "transient": _transient(orthogonalize, layout, design)}


def _orthogonalizes(design, layout, matrix) -> bool:
    """Whether this rank runs Newton-Schulz on `matrix` (for the GFLOP): its owner in (c), every
    holder of a piece otherwise."""
    if hasattr(design, "owner"):
        return design.owner[id(matrix.param)] == design.me
    return any(p.param is matrix.param for pieces in layout.pieces for p in pieces)


def _transient(design, layout, name: str) -> int:
    """The largest buffer step() allocates for U (and O), bf16 bytes (the module docstring)."""
    if name == "round_robin":
        return max((2 * 2 * layout.placement.buckets[i].padded_numel for i in design.buckets),
                   default=0)
    straddlers = [m for m in layout.matrices if m.straddles]
    return max((2 * design.n * design.longest(m) for m in straddlers), default=0)


def costs_worker(size: str, steps: int, batch: int) -> dict:
    """Every (stage, design) of STAGE_DESIGNS and AdamW alone at each stage, on this rank."""
    torch.set_num_threads(1)
    out = {}
    for stage, designs in STAGE_DESIGNS.items():
        out[(stage, None)] = _run(size, stage, None, steps, batch)
        for design in designs:
            out[(stage, design)] = _run(size, stage, design, steps, batch)
    return out


def costs(world_sizes=(2, 3, 4), size: str = "1M", steps: int = 3, batch: int = 12) -> list[dict]:
    """One record per (N, stage, design): every rank's figures (costs_worker), one launch per N.
    batch: global rows (divisible by every N: 12)."""
    assert set(DESIGNS) >= {d for ds in STAGE_DESIGNS.values() for d in ds}
    records = []
    for n in world_sizes:
        ranks = launch(costs_worker, n, size, steps, batch)
        for (stage, design), first in ranks[0].items():
            per_rank = [r[(stage, design)] for r in ranks]
            records.append({"world_size": n, "stage": stage, "design": design or "AdamW",
                            "ranks": per_rank,
                            "step_s": max(r["step_s"] for r in per_rank),
                            "optimizer_s": max(r["optimizer_s"] for r in per_rank)})
    return records


def format_costs(records: list[dict], size: str) -> str:
    """The table: per (N, stage, design), rank 0's bytes and the most any rank holds or does."""
    lines = [f"Muon's designs on the {size} GPT (usual split), per rank; measured = formula is "
             "checked; NS GFLOP and transient are modelled",
             f"{'N':>2} {'stage':>5} {'design':<12}{'Muon KB':>9}{'formula':>9}{'step KB':>9}"
             f"{'momentum KB (max)':>19}{'NS calls':>10}{'NS GFLOP (max)':>16}{'transient KB':>14}"
             f"{'opt ms':>8}{'step ms':>9}"]
    for r in records:
        first = r["ranks"][0]
        line = f"{r['world_size']:>2} {r['stage']:>5} {r['design']:<12}"
        if r["design"] == "AdamW":
            line += f"{'':>18}{first['total'] / 1e3:9.1f}{'':>59}"
        else:
            assert all(x["muon"] == x["muon_formula"] and x["momentum"] == x["momentum_formula"]
                       for x in r["ranks"]), "a design's measurement left its formula"
            calls = [x["ns_calls"] for x in r["ranks"]]
            line += (f"{first['muon'] / 1e3:9.1f}{first['muon_formula'] / 1e3:9.1f}"
                     f"{first['total'] / 1e3:9.1f}"
                     f"{max(x['momentum'] for x in r['ranks']) / 1e3:19.1f}"
                     f"{min(calls):>5}-{max(calls):<4}"
                     f"{max(x['ns_gflop'] for x in r['ranks']):16.3f}"
                     f"{max(x['transient'] for x in r['ranks']) / 1e3:14.1f}")
        lines.append(line + f"{r['optimizer_s'] * 1e3:8.1f}{r['step_s'] * 1e3:9.1f}")
    return "\n".join(lines)
