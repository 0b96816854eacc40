"""ZeRO-3's two layouts side by side, measured: flat buckets (minizero.wrap's stage 3, as FairScale,
DeepSpeed and FSDP1 lay them out) against per-parameter dim-0 shards (minizero.fully_shard, FSDP2).

    from minizero.lab.layouts import compare_layouts, format_layouts
    report = compare_layouts("default", world_size=3)      # one launch; every design, same data
    print(format_layouts(report))
    padding("default", 3)                                  # where each design pads (no launch)

Notebook 12 draws it; docs/pytorch.md has the table and its command. Every design shards the same
units (the GPT's blocks, each a unit, and the root holding the rest), trains the same steps with
AdamW in fp32 on the same rows, and ends at the same parameters (`max_param_diff`):

    flat                        wrap(model, 3): the root freed after forward, gathered again
    per-parameter               fully_shard per block, then the root with
                                reshard_after_forward=True: the flat design's schedule, so only
                                the layout differs
    per-parameter, root kept    fully_shard's default (FSDP2's): the root, whose parameters backward
                                needs first, stays gathered from forward to backward

Per rank, each design's model-state bytes are measured (each storage once: minizero.memory.measure)
and set beside its formula, padding included:

    flat            every unit's parameters end to end, padded once to a multiple of N
                    (flat.py): ceil(Ψ_u / N) elements per unit per rank, the same on every rank
    per-parameter   every parameter cut on dim 0 into ceil(d0 / N)-row shards, padded alike
                    ([Note: dim-0 shards], pytorch/fsdp_param.py): Σ ceil(d0/N)·row per rank;
                    the optimizer's state over the unpadded rows, so it differs between ranks

and per step: the collectives (counted on the event stream, by kind), their bytes (comm's tally:
the ring's, modelled; and memory/wire.py's bytes on the wire: measured, None where it cannot be),
the bytes copied in memory (every aten copy_ of one step, seen by a TorchDispatchMode: the
per-parameter layout copies each shard into the all-gather's buffer and each parameter out of it,
and each gradient into the reduce-scatter's; the flat layout's parameters are views of its buffer),
and the median step time (the slowest rank's, the first step left out), with its forward, backward
and optimizer step apart (lab/train.py's phases).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minizero import comm, events
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.peers import _memory, _without_sync, full_state_dict
from minizero.lab.reference import max_abs_diff
from minizero.lab.train import OPTIMIZERS, TrainConfig, clock, forward_backward, timed_step
from minizero.launcher import launch
from minizero.memory import wire
from minizero.pytorch import fully_shard
from minizero.pytorch.fsdp_param import padded_rows, shard_rows
from minizero.units import default_units
from minizero.wrap import wrap

DESIGNS = ("flat", "per-parameter", "per-parameter, root kept")
BYTES = 4                                   # fp32 parameters and gradients; AdamW: two moments


class Copies(TorchDispatchMode):
    """Every aten copy_ while active: how many, their bytes (the destination's) and seconds."""

    def __init__(self):
        super().__init__()
        self.count, self.nbytes, self.seconds = 0, 0, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not torch.ops.aten.copy_.default:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.perf_counter() - start
        self.count += 1
        self.nbytes += args[0].numel() * args[0].element_size()
        return out


def build(cfg: TrainConfig, design: str):
    """(module to call, backward, no_sync, step, the number of tensors the optimizer steps, a
    function returning this rank's model-state bytes, one returning the whole state)."""
    model = make_model(cfg.model_config(), seed=cfg.seed).to(comm.device())
    if design == "flat":
        engine = wrap(model, 3, cfg.optimizer_factory())             # units: the GPT's blocks
        stepped = sum(len(g["params"]) for g in engine.optimizer.optimizer.param_groups)
        return (engine, engine.backward, engine.no_sync, engine.step, stepped, engine.memory,
                engine.full_state_dict)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model, reshard_after_forward=True if design == "per-parameter" else None)
    optimizer = OPTIMIZERS[cfg.optimizer](model.parameters(), lr=cfg.lr, **cfg.optimizer_params)

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)              # the gradients' memory is kept
    return (model, torch.Tensor.backward, lambda: _without_sync(model), step,
            len(optimizer.param_groups[0]["params"]), lambda: _memory(model, optimizer),
            lambda: full_state_dict(model))


def layouts_worker(cfg: TrainConfig) -> dict:
    """Each design trained in turn on this rank, in one loop (lab/train.py's forward_backward, then
    the optimizer's step): its step times, the collectives counted per kind and their bytes per
    step (tally and wire, the training steps only), one more step's copies, its model-state bytes
    after the last step, the tensors its optimizer steps (AdamW keeps a 4-byte step count for each)
    and its final whole state."""
    torch.set_num_threads(1)
    out = {}
    for design in DESIGNS:
        module, backward, no_sync, step, stepped, memory, state = build(cfg, design)
        counted, times, phases = Counter(), [], []
        meter = None if wire.unavailable() else wire.WireMeter().start()
        with events.subscribed(lambda name, f: counted.update([f["kind"]])
                               if name == "collective" else None):
            for i in range(cfg.steps):
                comm.reset_tally()
                if meter:
                    meter.reset()
                start, phase = clock(), {}
                forward_backward(cfg, i, module, backward, no_sync, phase)
                timed_step(step, phase)
                times.append(clock() - start)
                phases.append(phase)
        on_wire = meter.bytes() if meter else None        # the last step's, as the tally's
        tally = comm.tally()
        with Copies() as copies:                  # one more step, its copies counted
            forward_backward(cfg, cfg.steps, module, backward, no_sync)
            step()
        if meter:
            meter.close()
        out[design] = {
            "step_times": times, "phase_times": phases, "stepped": stepped, "tally": tally,
            "wire": on_wire,
            "collectives": {kind: n / cfg.steps for kind, n in counted.items()},
            "copies": {"count": copies.count, "bytes": copies.nbytes, "seconds": copies.seconds},
            "memory": memory(), "state_dict": state(),
        }
    return out


def padding(model_name: str, world_size: int) -> dict[str, list[dict]]:
    """Where each design pads the model at N = world_size (no launch): per unit, the flat layout's
    elements past its parameters; per parameter, the per-parameter layout's rows past d0, and the
    rows each rank holds."""
    model, n = make_model(GPTConfig.named(model_name)), world_size
    units = default_units(model)
    in_units = {id(p) for u in units for p in u.parameters()}
    names = {id(p): name for name, p in model.named_parameters()}
    groups = [("blocks." + str(i), list(u.parameters())) for i, u in enumerate(units)]
    groups.insert(0, ("<root>", [p for p in model.parameters() if id(p) not in in_units]))
    flat = [{"unit": unit, "numel": sum(p.numel() for p in ps),
             "padding": -sum(p.numel() for p in ps) % n} for unit, ps in groups]
    per_parameter = []
    for unit, params in groups:
        for p in params:
            d0, chunk = p.shape[0], padded_rows(p.shape[0], n)
            per_parameter.append({"unit": unit, "name": names[id(p)], "shape": list(p.shape),
                                  "chunk": chunk, "padding_rows": chunk * n - d0,
                                  "padding": (chunk * n - d0) * p[0].numel(),
                                  "rows": [shard_rows(d0, n, r) for r in range(n)]})
    return {"flat": flat, "per-parameter": per_parameter}


def formulas(model_name: str, world_size: int, rank: int,
             stepped: dict[str, int]) -> dict[str, dict[str, int]]:
    """Each design's model-state bytes on `rank` (fp32, AdamW, nothing frozen) by the formulas
    above, and its padding (elements stored beyond the parameters, over all ranks). stepped: the
    tensors each design's optimizer steps, each with AdamW's 4-byte step count (flat: its
    cache-sized views of the shard, optim.py; per-parameter: one per parameter)."""
    n, where = world_size, padding(model_name, world_size)
    flat_elems = sum((u["numel"] + u["padding"]) // n for u in where["flat"])
    padded = sum(p["chunk"] * _row(p) for p in where["per-parameter"])
    rows = sum(p["rows"][rank] * _row(p) for p in where["per-parameter"])
    per_parameter = {"params": BYTES * padded, "grads": BYTES * padded,
                     "padding": sum(p["padding"] for p in where["per-parameter"])}
    return {
        "flat": {"params": BYTES * flat_elems, "grads": BYTES * flat_elems,
                 "optimizer": 2 * BYTES * flat_elems + 4 * stepped["flat"],
                 "padding": sum(u["padding"] for u in where["flat"])},
        **{design: {**per_parameter, "optimizer": 2 * BYTES * rows + 4 * stepped[design]}
           for design in DESIGNS[1:]},
    }


def _row(p: dict) -> int:
    """The elements of one row of dim 0."""
    return int(torch.Size(p["shape"][1:]).numel())


def compare_layouts(model: str = "default", world_size: int = 2, steps: int = 4,
                    batch_size: int = 24) -> dict:
    """One launch: every design on `model` at N = world_size. Per design and rank: memory measured
    and by formula; per design: collectives, bytes (tally, wire) and copies per step, median step
    time (the slowest rank's, the first step dropped); the largest parameter difference between
    the designs."""
    cfg = TrainConfig(stage=3, world_size=world_size, steps=steps, model=model,
                      batch_size=batch_size, backend="gloo")
    ranks = launch(layouts_worker, world_size, cfg, backend="gloo")
    report = {"model": model, "world_size": world_size, "steps": steps,
              "num_params": sum(p.numel() for p in make_model(cfg.model_config()).parameters()),
              "padding": padding(model, world_size), "designs": {}}
    for design in DESIGNS:
        step = statistics.median(max(ts) for ts in zip(*(r[design]["step_times"][1:]
                                                          for r in ranks)))
        phases = {phase: statistics.median(max(p[phase] for p in ps) for ps in
                                           zip(*(r[design]["phase_times"][1:] for r in ranks)))
                  for phase in ("forward", "backward", "step")}
        report["designs"][design] = {
            "memory": [{k: r[design]["memory"][k] for k in ("params", "grads", "optimizer")}
                       for r in ranks],
            "formula": [formulas(model, world_size, rank,
                                 {d: r[d]["stepped"] for d in DESIGNS})[design]
                        for rank, r in enumerate(ranks)],
            "collectives": ranks[0][design]["collectives"],
            "bytes_per_step": {k: v for k, v in ranks[0][design]["tally"].items()
                               if k in ("all_gather", "reduce_scatter", "total")},
            "wire_per_step": [r[design]["wire"] and r[design]["wire"]["total"] for r in ranks],
            "copies": ranks[0][design]["copies"],
            "step_time_s": step, "phase_times_s": phases,
        }
    report["max_param_diff"] = max(max_abs_diff(r["flat"]["state_dict"], r[d]["state_dict"])
                                   for r in ranks for d in DESIGNS[1:])
    return report


def format_layouts(report: dict) -> str:
    """The report as a table: per design, rank 0's bytes measured (formula), padding, collectives,
    bytes per step (ring model, on the wire), bytes copied per step and step time."""
    lines = [f"ZeRO-3's two layouts: GPT {report['model']} (Ψ = {report['num_params']:,}), "
             f"N = {report['world_size']}, fp32 AdamW; rank 0, bytes measured (formula)",
             f"{'design':<26}{'params':>18}{'grads':>18}{'optimizer':>20}{'padding':>9}"
             f"{'AG':>4}{'RS':>4}{'ring kB':>9}{'wire kB':>9}{'copied kB':>11}{'ms/step':>9}"]
    for design, d in report["designs"].items():
        mem, formula = d["memory"][0], d["formula"][0]
        cells = "".join(f"{mem[k]:,} ({formula[k]:,})".rjust(20 if k == 'optimizer' else 18)
                        for k in ("params", "grads", "optimizer"))
        wire_kb = "n/a" if d["wire_per_step"][0] is None else f"{d['wire_per_step'][0] / 1e3:.1f}"
        lines.append(f"{design:<26}{cells}{formula['padding']:>9,}"
                     f"{d['collectives'].get('all_gather', 0):>4.0f}"
                     f"{d['collectives'].get('reduce_scatter', 0):>4.0f}"
                     f"{d['bytes_per_step']['total'] / 1e3:>9.1f}{wire_kb:>9}"
                     f"{d['copies']['bytes'] / 1e3:>11.1f}{d['step_time_s'] * 1e3:>9.1f}")
    lines.append("AG, RS: all-gathers and reduce-scatters a step; ring kB: comm's tally (the "
                 "ring's bytes, modelled), wire kB: what gloo sent (measured); padding: elements "
                 "stored beyond the parameters over all ranks; the largest parameter difference "
                 f"between the designs after {report['steps']} steps: "
                 f"{report['max_param_diff']:.1e}")
    return "\n".join(lines)
