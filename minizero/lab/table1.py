"""The ZeRO paper's Table 1 at small scale, measured: for each mesh (N_m, N_d) of N ranks and each
stage, the largest of a ladder of minizero GPTs whose model states fit a device budget, trained
one step next to the one a size up, which should not fit.

    python -m minizero.memory --table1 --measure --device-gb 0.001 --world-size 4
    from minizero.lab import table1
    rows = table1.measure(device_bytes=1e6, world_size=4)

The paper's Table 1 is an estimate: Ψ_max = device bytes / (bytes a parameter on one rank), every
parameter split M ways (minizero/memory/mesh.py, largest_model). A real split GPT keeps some
parameters whole on every rank of a row (LayerNorms, position embeddings, row-parallel biases), so
what a rank holds is Ψ_rank = params_per_rank(split, replicated, M), a little more than Ψ/M. Here
the ladder's models are counted exactly that way (on the meta device, no memory), the formula
with Ψ_rank and N_d picks the largest that fits, and both it and the next rung are trained on the
mesh: engine.memory()'s model states must equal the formula (up to padding), the first within the
budget, the second over it.
"""

from __future__ import annotations

import types

import torch

from minizero.beyond import tensor_parallel
from minizero.lab.model import GPT, GPTConfig
from minizero.lab.train import TrainConfig, state_bytes, train_several
from minizero.launcher import launch
from minizero.memory import element_bytes, estimate_breakdown, optimizer_k
from minizero.memory.mesh import largest_model

DTYPE, OPTIMIZER = "fp32", "adamw"        # 4 + 4 + K = 8 bytes a parameter (fp32 AdamW, no master)
LADDER = {"n_layer": 2, "n_head": 4, "block_size": 9}     # the rungs differ in width h only
WIDTH_STEP = 4                                            # h = 4, 8, 12, ...: every M of 1, 2, 4
STATES = ("params", "grads", "optimizer")


def sizes() -> dict:
    """Bytes a parameter per category, as estimate_breakdown takes them."""
    elem = element_bytes(DTYPE)
    return {"param_bytes": elem, "grad_bytes": elem, "k": optimizer_k(state_bytes(OPTIMIZER),
                                                                       DTYPE)}


def meshes(world_size: int) -> list[tuple[int, int]]:
    """(N_m, N_d) for every M dividing N that the ladder splits (4 heads: M of 1, 2, 4)."""
    return [(m, world_size // m) for m in (1, 2, 4) if world_size % m == 0]


def rung(width: int) -> GPTConfig:
    return GPTConfig(n_embd=width, **LADDER)


def params_on_a_rank(width: int, m: int) -> tuple[int, int]:
    """(Ψ of the whole GPT, Ψ_rank: what one rank of a tensor-parallel row of m holds), counted
    on the meta device."""
    with torch.device("meta"):
        model = GPT(rung(width))
        whole = sum(p.numel() for p in model.parameters())
        if m > 1:                                    # splitting needs no collective
            tensor_parallel.parallelize_gpt(model, types.SimpleNamespace(size=m, index=0))
        return whole, sum(p.numel() for p in model.parameters())


def model_states(width: int, m: int, data_parallel: int, stage: int) -> float:
    """The formula's model-state bytes on one rank: estimate_breakdown(Ψ_rank, N_d, stage)."""
    b = estimate_breakdown(params_on_a_rank(width, m)[1], data_parallel, stage, **sizes())
    return sum(b[c] for c in STATES)


def largest_width(device_bytes: float, m: int, data_parallel: int, stage: int) -> int:
    """The widest rung whose model states (the formula with Ψ_rank) fit `device_bytes`."""
    width = WIDTH_STEP
    if model_states(width, m, data_parallel, stage) > device_bytes:
        raise ValueError(f"{device_bytes:.0f} bytes hold not even the narrowest GPT (h = "
                         f"{width}) at stage {stage} on {m} x {data_parallel}")
    while model_states(width + WIDTH_STEP, m, data_parallel, stage) <= device_bytes:
        width += WIDTH_STEP
    return width


def plan(device_bytes: float, world_size: int, stages=range(4)) -> list[dict]:
    """Every (mesh, stage): the paper's estimate Ψ_max and the two rungs to train."""
    rows = []
    for m, n_d in meshes(world_size):
        for stage in stages:
            width = largest_width(device_bytes, m, n_d, stage)
            rows.append({"model_parallel": m, "data_parallel": n_d, "stage": stage,
                         "estimate": largest_model(device_bytes, m, n_d, stage, **sizes()),
                         "rungs": [{"width": w, "fits": w == width}
                                   for w in (width, width + WIDTH_STEP)]})
    return rows


def measure(device_bytes: float, world_size: int = 4, stages=range(4)) -> list[dict]:
    """plan(), every rung trained on its mesh (one launch): each rung gets Ψ, Ψ_rank,
    the formula's bytes and rank 0's measured model states (engine.memory()) and peak."""
    rows = plan(device_bytes, world_size, stages)
    # two steps: memory() is read in the last one's backward, after Adam made its state in the first
    cfgs = [TrainConfig(stage=r["stage"], world_size=world_size, dtype=DTYPE, optimizer=OPTIMIZER,
                        tensor_parallel=r["model_parallel"], steps=2, batch_size=r["data_parallel"],
                        model_overrides={"n_embd": rung_["width"], **LADDER})
            for r in rows for rung_ in r["rungs"]]
    results = iter(launch(train_several, world_size, cfgs)[0])          # rank 0's
    for r in rows:
        for rung_ in r["rungs"]:
            result = next(results)
            whole, on_rank = params_on_a_rank(rung_["width"], r["model_parallel"])
            memory = result["memory"]
            rung_ |= {"params": whole, "params_per_rank": on_rank,
                      "formula": model_states(rung_["width"], r["model_parallel"],
                                              r["data_parallel"], r["stage"]),
                      "measured": sum(memory[c] for c in STATES), "peak": memory["peak"]}
    return rows


def table(rows: list[dict], device_bytes: float, world_size: int) -> str:
    """measure()'s rows as `python -m minizero.memory --table1 --measure` prints them."""
    out = [f"The paper's Table 1 at small scale, measured: N = {world_size} ranks, "
           f"{device_bytes / 1e6:g} MB of model states per rank",
           f"({DTYPE} AdamW: {sum(sizes().values())} bytes a parameter), minizero's GPT of "
           f"{LADDER['n_layer']} blocks, width h", "",
           f"{'N_m x N_d':>9} {'stage':>5} {'Ψ_max estimate':>15} {'fits: h':>8} {'Ψ':>9} "
           f"{'Ψ_rank':>8} {'measured kB':>12} {'formula kB':>11} {'peak kB':>8}   "
           f"{'next: h':>7} {'measured kB':>12}"]
    for r in rows:
        fit, over = r["rungs"]
        out.append(f"{r['model_parallel']:>5} x {r['data_parallel']:<1} {r['stage']:>5} "
                   f"{r['estimate']:>15,.0f} {fit['width']:>8} {fit['params']:>9,} "
                   f"{fit['params_per_rank']:>8,} {fit['measured'] / 1e3:>12.1f} "
                   f"{fit['formula'] / 1e3:>11.1f} {fit['peak'] / 1e3:>8.1f}   "
                   f"{over['width']:>7} {over['measured'] / 1e3:>12.1f}")
    out += ["",
            "Ψ_max: the paper's estimate (every parameter split M ways). A split GPT keeps its",
            "LayerNorms, position embeddings and row-parallel biases whole on every rank of a",
            "row (Ψ_rank > Ψ/M), so the largest that fits is a little smaller. Measured:",
            "engine.memory()'s model states = the formula with Ψ_rank (+ Adam's step counters, a",
            "few bytes); the peak adds what a step holds briefly (stage 2's staged buckets, stage",
            "3's gathered units)."]
    return "\n".join(out)
