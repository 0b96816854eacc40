"""ZeRO-3's two layouts side by side, measured: flat buckets (minizero.wrap's stage 3, as FairScale,
DeepSpeed and FSDP1 lay them out) against per-parameter dim-0 shards (minizero.fully_shard, FSDP2).

    from minizero.lab.layouts import compare_layouts, format_layouts
    report = compare_layouts("default", world_size=3)      # one launch; both designs, same data
    print(format_layouts(report))

Both shard the same units (the GPT's blocks, each a unit, and the root holding the rest), train the
same steps with AdamW in fp32 on the same rows, and end at the same parameters (`max_param_diff`).
Per rank, each design's model-state bytes are measured (each storage once: minizero.memory.measure)
and set beside its formula, padding included:

    flat            every unit's parameters end to end, padded once to a multiple of N
                    (flat.py): ceil(Ψ_u / N) elements per unit per rank, the same on every rank
    per-parameter   every parameter cut on dim 0 into ceil(d0 / N)-row shards, padded alike
                    ([Note: dim-0 shards], pytorch/fsdp_param.py): Σ ceil(d0/N)·row per rank;
                    the optimizer's state over the unpadded rows, so it differs between ranks

and the collectives of a step, as minizero's tally and event stream see them (count and bytes by
kind), and the median step time. The flat layout pads at most N - 1 elements per unit, the
per-parameter one up to N - 1 rows per parameter; in exchange each shard is a tensor of its own
shape (a DTensor), which per-parameter optimizers, clip_grad_norm_ and checkpoints use as they are.
"""

from __future__ import annotations

import statistics
from collections import Counter

import torch

from minizero import comm, events
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.peers import _memory, build_front_end, full_state_dict
from minizero.lab.reference import max_abs_diff
from minizero.lab.train import TrainConfig, clock, forward_backward
from minizero.launcher import launch
from minizero.units import default_units
from minizero.wrap import wrap

DESIGNS = ("flat", "per-parameter")
BYTES = 4                                   # fp32 parameters and gradients; AdamW: two moments


def layouts_worker(cfg: TrainConfig) -> dict:
    """Each design trained in turn on this rank, in one loop (lab/train.py's forward_backward, then
    the optimizer's step): its step times, the collectives counted per kind and the tally's bytes
    per step (the training steps only), its model-state bytes after the last step, the tensors
    its optimizer steps (AdamW keeps a 4-byte step count for each) and its final whole state."""
    torch.set_num_threads(1)
    out = {}
    for design in DESIGNS:
        model = make_model(cfg.model_config(), seed=cfg.seed)
        if design == "flat":
            engine = wrap(model, 3, cfg.optimizer_factory())        # units: the GPT's blocks
            module, backward, no_sync, step = engine, engine.backward, engine.no_sync, engine.step
            stepped = sum(len(g["params"]) for g in engine.optimizer.optimizer.param_groups)
        else:
            module, optimizer, no_sync = build_front_end(cfg, "fully_shard")
            backward, stepped = torch.Tensor.backward, len(optimizer.param_groups[0]["params"])

            def step(optimizer=optimizer):
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)       # the gradients' memory is kept
        counted, times = Counter(), []
        with events.subscribed(lambda name, f: counted.update([f["kind"]])
                               if name == "collective" else None):
            for i in range(cfg.steps):
                comm.reset_tally()
                start = clock()
                forward_backward(cfg, i, module, backward, no_sync)
                step()
                times.append(clock() - start)
        out[design] = {
            "step_times": times, "stepped": stepped, "tally": comm.tally(),
            "collectives": {kind: n / cfg.steps for kind, n in counted.items()},
            "memory": (engine.memory() if design == "flat" else _memory(module, optimizer)),
            "state_dict": (engine.full_state_dict() if design == "flat"
                           else full_state_dict(module)),
        }
    return out


def formulas(model_name: str, world_size: int, rank: int,
             stepped: dict[str, int]) -> dict[str, dict[str, int]]:
    """Each design's model-state bytes on `rank` (fp32, AdamW, nothing frozen) by the formulas
    above, and its padding (elements stored beyond the parameters, over all ranks). stepped: the
    tensors each design's optimizer steps, each with AdamW's 4-byte step count (flat: its
    cache-sized views of the shard, optim.py; per-parameter: one per parameter)."""
    model = make_model(GPTConfig.named(model_name))
    n, flat_elems = world_size, 0
    units = default_units(model)
    in_units = {id(p) for u in units for p in u.parameters()}
    buckets = [[p for p in u.parameters()] for u in units]
    buckets.append([p for p in model.parameters() if id(p) not in in_units])   # the root's
    for params in buckets:
        flat_elems += -(-sum(p.numel() for p in params) // n)
    psi = sum(p.numel() for p in model.parameters())
    padded = rows = 0
    for p in model.parameters():
        d0, row = p.shape[0], p[0].numel()
        chunk = -(-d0 // n)
        padded += chunk * row
        rows += max(0, min(chunk, d0 - rank * chunk)) * row
    return {
        "flat": {"params": BYTES * flat_elems, "grads": BYTES * flat_elems,
                 "optimizer": 2 * BYTES * flat_elems + 4 * stepped["flat"],
                 "padding": flat_elems * n - psi},
        "per-parameter": {"params": BYTES * padded, "grads": BYTES * padded,
                          "optimizer": 2 * BYTES * rows + 4 * stepped["per-parameter"],
                          "padding": padded * n - psi},
    }


def compare_layouts(model: str = "default", world_size: int = 2, steps: int = 4,
                    batch_size: int = 24) -> dict:
    """One launch: both designs on `model` at N = world_size. Per design and rank: memory measured
    and by formula; per design: collectives and bytes per step, median step time (the slowest
    rank's, the first step dropped); the largest parameter difference between the designs."""
    cfg = TrainConfig(stage=3, world_size=world_size, steps=steps, model=model,
                      batch_size=batch_size, backend="gloo")
    ranks = launch(layouts_worker, world_size, cfg, backend="gloo")
    report = {"model": model, "world_size": world_size, "steps": steps,
              "num_params": sum(p.numel() for p in make_model(cfg.model_config()).parameters()),
              "designs": {}}
    for design in DESIGNS:
        step = statistics.median(max(ts) for ts in zip(*(r[design]["step_times"][1:]
                                                          for r in ranks)))
        report["designs"][design] = {
            "memory": [{k: r[design]["memory"][k] for k in ("params", "grads", "optimizer")}
                       for r in ranks],
            "formula": [formulas(model, world_size, rank,
                                 {d: r[d]["stepped"] for d in DESIGNS})[design]
                        for rank, r in enumerate(ranks)],
            "collectives": ranks[0][design]["collectives"],
            "bytes_per_step": {k: v for k, v in ranks[0][design]["tally"].items()
                               if k in ("all_gather", "reduce_scatter", "total")},
            "step_time_s": step,
        }
    report["max_param_diff"] = max(
        max_abs_diff(r["flat"]["state_dict"], r["per-parameter"]["state_dict"]) for r in ranks)
    return report


def format_layouts(report: dict) -> str:
    """The report as a table: per design, rank 0's bytes measured (formula), padding, collectives
    and MB per step, step time."""
    lines = [f"ZeRO-3's two layouts: GPT {report['model']} (Ψ = {report['num_params']:,}), "
             f"N = {report['world_size']}, fp32 AdamW; rank 0, bytes measured (formula)",
             f"{'design':<14}{'params':>20}{'grads':>20}{'optimizer':>22}{'padding':>10}"
             f"{'all-gathers':>13}{'reduce-scatters':>17}{'MB/step':>9}{'ms/step':>9}"]
    for design, d in report["designs"].items():
        mem, formula = d["memory"][0], d["formula"][0]
        cells = "".join(f"{mem[k]:>11,} ({formula[k]:>,})".rjust(20 if k != 'optimizer' else 22)
                        for k in ("params", "grads", "optimizer"))
        lines.append(f"{design:<14}{cells}{formula['padding']:>10,}"
                     f"{d['collectives'].get('all_gather', 0):>13.0f}"
                     f"{d['collectives'].get('reduce_scatter', 0):>17.0f}"
                     f"{d['bytes_per_step']['total'] / 1e6:>9.3f}{d['step_time_s'] * 1e3:>9.1f}")
    lines.append(f"padding: elements stored beyond the parameters over all ranks; the largest "
                 f"parameter difference between the designs after {report['steps']} steps: "
                 f"{report['max_param_diff']:.1e}")
    return "\n".join(lines)
