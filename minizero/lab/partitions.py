"""Two ways to give each rank 1/N of the optimizer states, measured on one model: the paper's flat
partition by element (zero1.py, as DeepSpeed) and whole parameters per rank (torch's
ZeroRedundancyOptimizer, minizero/pytorch/zero_redundancy.py).

    python -m minizero.bench --partitions                       # the default GPT at N = 2, 3, 4
    python -m minizero.bench --partitions --world-size 2 --model tiny --json p.json

Both sides train the same GPT with AdamW for two steps on the same data: `minizero.wrap(model, 1,
...)` and minizero.DistributedDataParallel + minizero.ZeroRedundancyOptimizer. Per rank, after the
second step: the elements it steps, the bytes of its optimizer state (what the optimizer holds:
Adam's two moments and its step counters, counted as memory.measure counts), and the collectives
of that step with the bytes comm.py's tally gives them (the ring model of comm.py, not bytes seen
on the wire). A small GPT's parameters are many and alike, so whole parameters balance well; what
unbalances them is one parameter larger than Ψ/N. So the report adds GPT-2 small's shapes (a
50,257-token embedding, 31 % of Ψ), partitioned by the same rule without training: modelled.
"""

from __future__ import annotations

import functools

import torch

import minizero
from minizero import comm
from minizero.lab.data import global_batch, local_batch
from minizero.lab.model import GPTConfig, count_params, make_model
from minizero.lab.record import recorded
from minizero.lab.train import loss_fn
from minizero.memory import measure
from minizero.pytorch.zero_redundancy import whole_parameters

SIDES = ("flat (stage 1)", "whole (torch's)")
LR = 1e-3


def partition_worker(model_name: str, steps: int = 2) -> dict:
    """This rank's figures for both sides (SIDES)."""
    cfg = GPTConfig.named(model_name)
    out = {}
    for side in SIDES:
        model = make_model(cfg, seed=0)
        if side == SIDES[0]:
            engine = minizero.wrap(model, 1, functools.partial(torch.optim.AdamW, lr=LR))
            forward, optimizer, step = engine, engine.optimizer.optimizer, engine.step
            stepped = engine.layout.shard_numel                    # its partition, padding too
            padding = engine.layout.padded_numel - engine.layout.numel
        else:
            forward = minizero.DistributedDataParallel(model)
            zero = minizero.ZeroRedundancyOptimizer(forward.parameters(), torch.optim.AdamW,
                                                    lr=LR)
            optimizer, step, padding = zero.optim, zero.step, 0
            stepped = sum(p.numel() for g in zero.partition[zero.rank] for p in g)
        for i in range(steps):
            x, y = global_batch(i, 12, cfg.block_size)
            x, y = local_batch(x, y, comm.rank(), comm.world_size())
            comm.reset_tally()
            with recorded("collective") as log:
                loss_fn(forward(x), y).backward()
                step()
                if side == SIDES[1]:
                    zero.zero_grad()
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        out[side] = {"stepped": stepped, "padding": padding,
                     "optimizer_bytes": measure({"optimizer": state})["optimizer"],
                     "collectives": len(log), "sent": comm.tally()}
    return out


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """GPT-2 small's parameters in its order (the head is tied to the token embedding)."""
    d, vocab, positions, layers = 768, 50257, 1024, 12
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,),
             (4 * d, d), (d,)]
    return [(vocab, d), (positions, d)] + block * layers + [(d,), (d,)]


def modelled(shapes: list[tuple[int, ...]], world_sizes) -> list[dict]:
    """Elements per rank for whole parameters (whole_parameters, on meta tensors: no memory) and
    for a flat partition (ceil(Ψ/N), the last rank's padding aside), per N."""
    params = [torch.empty(shape, device="meta") for shape in shapes]
    psi = sum(p.numel() for p in params)
    rows = []
    for n in world_sizes:
        held = [sum(p.numel() for g in groups for p in g)
                for groups in whole_parameters([params], n)]
        rows.append({"world_size": n, "whole": held, "flat": -(-psi // n),
                     "imbalance": max(held) / min(held)})
    return rows


def measure_partitions(world_sizes=(2, 3, 4), model: str = "default") -> dict:
    """{"model", "num_params", "rows": one per (N, side) with every rank's figures, "gpt2_small":
    the modelled rows (modelled)}."""
    rows = []
    for n in world_sizes:
        per_rank = minizero.launch(partition_worker, n, model)
        for side in SIDES:
            ranks = [r[side] for r in per_rank]
            state = [r["optimizer_bytes"] for r in ranks]
            rows.append({"world_size": n, "side": side, "ranks": ranks,
                         "imbalance": max(state) / min(state) if min(state) else float("inf")})
    return {"model": model, "num_params": count_params(GPTConfig.named(model)), "rows": rows,
            "gpt2_small": modelled(gpt2_small_shapes(), world_sizes)}


def format_table(report: dict) -> str:
    lines = [f"optimizer states over N ranks, {report['model']} GPT (Ψ = "
             f"{report['num_params']:,}), AdamW: per rank after the second step",
             f"{'N':>2} {'partition':<16}{'stepped':>20}{'state kB':>22}{'max/min':>8}"
             f"{'padding':>8}{'coll.':>6}{'sent kB (ring model)':>22}"]
    for row in report["rows"]:
        ranks = row["ranks"]
        stepped = " / ".join(f"{r['stepped']:,}" for r in ranks)
        state = " / ".join(f"{r['optimizer_bytes'] / 1e3:.0f}" for r in ranks)
        lines.append(
            f"{row['world_size']:>2} {row['side']:<16}{stepped:>20}{state:>22}"
            f"{row['imbalance']:8.3f}{ranks[0]['padding']:8,}{ranks[0]['collectives']:6}"
            f"{ranks[0]['sent']['total'] / 1e3:22,.0f}")
    lines.append("stepped: elements each rank's optimizer steps (flat: padding included); "
                 "max/min: of the state bytes; coll.: collectives in the step, rank 0")
    lines.append("")
    lines.append("GPT-2 small's shapes, modelled (the same rule, no training): millions of "
                 "elements per rank")
    lines.append(f"{'N':>2} " + "whole (torch's)".ljust(44) + f"{'max/min':>8}{'flat':>16}")
    for row in report["gpt2_small"]:
        whole = " / ".join(f"{e / 1e6:.1f}" for e in row["whole"])
        lines.append(f"{row['world_size']:>2} {whole:<44}{row['imbalance']:8.2f}"
                     f"{row['flat'] / 1e6:16.1f}")
    return "\n".join(lines)
