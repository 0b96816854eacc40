"""minizero against PyTorch's own implementation of every stage: time, memory, communication, result.

    python -m minizero.bench                                        # N = 2 and 4, the default model
    python -m minizero.bench --world-size 2 --steps 20 --repeats 5 --json bench.json
    python -m minizero.bench --scale --budget-mb 4                  # the scale demo (minizero.scale)
    python -m minizero.bench --scale --micro-batch                  # ... its largest micro-batch per stage

Pairs (minizero.lab.peers builds PyTorch's side, trained by the same loop as minizero.lab.train):
    stage 0  <->  torch.nn.parallel.DistributedDataParallel
    stage 1  <->  torch.distributed.optim.ZeroRedundancyOptimizer (over DDP)
    stage 2  <->  FSDP2 fully_shard per block + root, reshard_after_forward=False
    stage 3  <->  FSDP2 fully_shard per block + root
Same GPT, same initial weights, same data, fp32, same AdamW, same world size, gloo on the CPU.

How it is fair: one launch per world size runs every pair in the same processes; within a repeat each
pair runs minizero and PyTorch back to back, in alternating order (AB, then BA, ...), so a slow patch of
a shared machine hits both sides alike. A step's time is the slowest rank's (collectives make every rank
wait for it); the first step of every run is warm-up and dropped; the ratio compares medians.
Every rank computes with one intra-op thread, so both sides see the same CPU however many cores exist.

Reported per pair: ratio = median step time minizero / PyTorch; per-rank model-state bytes (minizero's
engine.memory(); PyTorch's counted from its parameters, .grad and optimizer state by
minizero.memory.measure); bytes sent per step (minizero's tally; for PyTorch the ring formula of the
collectives it issues: it has no tally); and the largest |parameter difference| after the run.

And what minizero's own measurement costs: engine(x) runs the forward under the activation meter
(activations.py: a saved-tensor hook per tensor forward saves, engine.memory()["activations"]);
`engine.activations.enabled = False` turns it off. Both run the same loop (meter_worker), in alternating
order like the pairs, and must end at the same losses: the meter only observes.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch

from minizero import comm
from minizero.cli import OneLineParser, UsageError, emit, fail
from minizero.lab.model import MODEL_NAMES, make_model
from minizero.lab.peers import PEER_OF_STAGE, peer_worker
from minizero.lab.reference import max_abs_diff
from minizero.lab.train import TrainConfig, forward_backward, train_worker
from minizero.launcher import launch
from minizero.wrap import wrap

IMPLS = ("minizero", "torch")
METER = ("meter on", "meter off")       # minizero with and without the activation meter (meter_worker)
MEMORY_KEYS = ("params", "grads", "optimizer")

# The collectives each PyTorch peer issues per step, each over the full Ψ (the ring bytes of comm.py).
# ZeroRedundancyOptimizer sits on DDP: a full all-reduce, then each rank broadcasts the partition it
# stepped (N broadcasts of Ψ/N: Ψ). That is 3Ψ where ZeRO stage 1 needs 2Ψ (reduce-scatter + all-gather).
# FSDP2 does not gather its root unit a second time for backward; the few root parameters are ignored.
PEER_COLLECTIVES = {
    "ddp": ("all_reduce",),
    "zero_redundancy": ("all_reduce", "broadcast"),
    "fsdp2_no_reshard": ("all_gather", "reduce_scatter"),
    "fsdp2": ("all_gather", "all_gather", "reduce_scatter"),
}


def peer_comm_bytes(peer: str, num_params: int, world_size: int, bytes_per_elem: int = 4) -> float:
    """Bytes one rank sends per step in a ring for PyTorch's `peer` (fp32: 4 bytes per element)."""
    full = num_params * bytes_per_elem
    return sum(comm.ring_bytes(kind, full, world_size) for kind in PEER_COLLECTIVES[peer])


# --------------------------------------------------------------------------------------------------------
# Worker: every pair, every repeat, in one process group
# --------------------------------------------------------------------------------------------------------

def meter_worker(cfg: TrainConfig, meter: bool) -> dict:
    """minizero's training loop (train_worker's, without its bookkeeping) with the activation meter on or
    off: step times, losses, the activations' peak."""
    engine = wrap(make_model(cfg.model_config(), seed=cfg.seed), cfg.stage, cfg.optimizer_factory(),
                  offload=cfg.offload, **cfg.engine_options())
    engine.activations.enabled = meter
    step_times, losses = [], []
    for step in range(cfg.steps):
        start = time.perf_counter()
        losses.append(forward_backward(cfg, step, engine, engine.backward, engine.no_sync))
        engine.step()
        if comm.device().type == "cuda":
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - start)
    return {"step_times": step_times, "losses": losses, "activations": engine.memory()["activations"]}


def bench_worker(cfgs: list[TrainConfig], repeats: int) -> list[dict]:
    """Per configuration: step times of every repeat of both sides (and of minizero with the activation
    meter on and off), memory and comm of the first repeat, and the max |minizero - PyTorch| over all
    parameters after it (both full state dicts, on this rank)."""
    torch.set_num_threads(1)
    out = [{"times": {impl: [] for impl in IMPLS + METER}} for _ in cfgs]
    for rep in range(repeats):
        for cfg, record in zip(cfgs, out):
            run_cfg = dataclasses.replace(cfg, return_state=rep == 0)
            results = {}
            for impl in (IMPLS + METER) if rep % 2 == 0 else (IMPLS[::-1] + METER[::-1]):
                comm.barrier()                  # both sides start from the same line
                if impl == "minizero":
                    results[impl] = train_worker(run_cfg)
                elif impl == "torch":
                    results[impl] = peer_worker(run_cfg, PEER_OF_STAGE[cfg.stage])
                else:
                    results[impl] = meter_worker(cfg, impl == "meter on")
                record["times"][impl].append(results[impl]["step_times"])
            if rep == 0:
                record["meter_losses"] = {m: results[m]["losses"] for m in METER}
                record["meter_activations"] = {m: results[m]["activations"] for m in METER}
            if rep == 0:
                mz, pt = results["minizero"], results["torch"]
                record["max_param_diff"] = max_abs_diff(mz.pop("state_dict"), pt.pop("state_dict"))
                record["num_params"] = mz["num_params"]
                record["memory"] = {"minizero": mz["memory"], "torch": pt["memory"]}
                record["peak"] = mz["peak"]
                record["comm"] = mz["comm_bytes_per_step"]["total"]
                record["final_loss"] = {"minizero": mz["losses"][-1], "torch": pt["losses"][-1]}
    return out


# --------------------------------------------------------------------------------------------------------
# Parent: one launch per world size, then the table
# --------------------------------------------------------------------------------------------------------

def compare(world_sizes=(2, 4), *, steps: int = 10, repeats: int = 3, model: str = "default",
            stages=(0, 1, 2, 3), batch_size: int = 16) -> dict:
    """{"config": ..., "pairs": [one record per (N, stage)]}; see the module docstring for the fields."""
    pairs = []
    for n in world_sizes:
        cfgs = [TrainConfig(stage=s, world_size=n, steps=steps, model=model, batch_size=batch_size,
                            backend="gloo") for s in stages]
        per_rank = launch(bench_worker, n, cfgs, repeats, backend="gloo")
        for i, cfg in enumerate(cfgs):
            ranks = [rank_records[i] for rank_records in per_rank]
            pairs.append(_pair_record(cfg, ranks))
    return {"config": {"world_sizes": list(world_sizes), "steps": steps, "repeats": repeats,
                       "model": model, "batch_size": batch_size, "backend": "gloo", "dtype": "fp32",
                       "optimizer": "adamw", "threads_per_rank": 1},
            "pairs": pairs}


def _pair_record(cfg: TrainConfig, ranks: list[dict]) -> dict:
    peer = PEER_OF_STAGE[cfg.stage]
    first = ranks[0]
    medians = {impl: statistics.median(_slowest_rank_steps(ranks, impl)) for impl in IMPLS + METER}
    psi = first["num_params"]
    return {
        "world_size": cfg.world_size, "stage": cfg.stage, "peer": peer, "num_params": psi,
        "step_time_s": {impl: medians[impl] for impl in IMPLS},
        "ratio": medians["minizero"] / medians["torch"],
        # the activation meter: minizero's step time with it on and off, what it saw, the losses of both
        "meter": {"step_time_s": {m.split()[1]: medians[m] for m in METER},
                  "cost": medians["meter on"] / medians["meter off"] - 1,
                  "activations": {m.split()[1]: [r["meter_activations"][m] for r in ranks] for m in METER},
                  "losses": {m.split()[1]: first["meter_losses"][m] for m in METER}},
        "memory": {impl: [{k: r["memory"][impl][k] for k in MEMORY_KEYS} for r in ranks] for impl in IMPLS},
        "minizero_peak": [r["peak"] for r in ranks],
        "comm_bytes_per_step": {"minizero": first["comm"],
                                "torch": peer_comm_bytes(peer, psi, cfg.world_size)},
        "max_param_diff": max(r["max_param_diff"] for r in ranks),
        "final_loss": first["final_loss"],
    }


def _slowest_rank_steps(ranks: list[dict], impl: str) -> list[float]:
    """Each step's time on its slowest rank, warm-up steps (the first of every run) dropped."""
    out = []
    for rep, per_rank_runs in enumerate(zip(*(r["times"][impl] for r in ranks))):
        steps = [max(ts) for ts in zip(*per_rank_runs)]
        out += steps[1:] or steps
    return out


def format_table(report: dict) -> str:
    kb = lambda x: f"{x / 1e3:8.1f}"      # noqa: E731
    c = report["config"]
    lines = [f"minizero vs PyTorch, model {c['model']}, {c['steps']} steps x {c['repeats']} repeats, "
             f"{c['backend']}, {c['dtype']} AdamW, rank 0's model states in kB",
             f"{'N':>2} {'stage':>5} {'peer':<17}{'mz ms':>7}{'pt ms':>7}{'ratio':>7}"
             f"{'mz dev kB':>10}{'pt dev kB':>10}{'mz comm':>9}{'pt comm':>9}{'max |Δp|':>10}"]
    for p in report["pairs"]:
        dev = {impl: sum(p["memory"][impl][0].values()) for impl in IMPLS}
        lines.append(f"{p['world_size']:>2} {p['stage']:>5} {p['peer']:<17}"
                     f"{p['step_time_s']['minizero'] * 1e3:7.2f}{p['step_time_s']['torch'] * 1e3:7.2f}"
                     f"{p['ratio']:7.2f}  {kb(dev['minizero'])}  {kb(dev['torch'])}"
                     f" {kb(p['comm_bytes_per_step']['minizero'])} {kb(p['comm_bytes_per_step']['torch'])}"
                     f"{p['max_param_diff']:10.1e}")
    lines.append("ratio = median step time minizero / PyTorch (< 1: minizero faster). PyTorch comm: ring "
                 "formula of its collectives.")
    lines.append("")
    lines.append("the activation meter (engine(x) vs engine.module(x), same loop): minizero's median step time")
    lines.append(f"{'N':>2} {'stage':>5}{'on ms':>8}{'off ms':>8}{'cost':>8}{'activ. kB':>11}")
    for p in report["pairs"]:
        m = p["meter"]
        lines.append(f"{p['world_size']:>2} {p['stage']:>5}{m['step_time_s']['on'] * 1e3:8.2f}"
                     f"{m['step_time_s']['off'] * 1e3:8.2f}{m['cost'] * 100:7.1f}%{m['activations']['on'][0] / 1e3:11.1f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    prog = "python -m minizero.bench"
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--scale" in argv:                       # the scale demo has its own flags (minizero.scale)
        from minizero.lab import scale
        argv.remove("--scale")
        return scale.main(argv)
    ap = OneLineParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, nargs="+", default=[2, 4], help="one or more N (default 2 4)")
    ap.add_argument("--steps", type=int, default=10, help="steps per run (default 10, the first is warm-up)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side per pair (default 3)")
    ap.add_argument("--model", default="default", help=" or ".join(MODEL_NAMES))
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], help="stages to compare")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    ap.add_argument("--scale", action="store_true", help="run the scale demo instead (see minizero.scale; "
                    "takes --budget-mb, --world-size, --micro-batch, --model, --json)")
    try:
        args = ap.parse_args(argv)
        _validate(args)
    except UsageError as e:
        return fail(prog, str(e))
    try:
        report = compare(tuple(args.world_size), steps=args.steps, repeats=args.repeats, model=args.model,
                         stages=tuple(args.stages))
    except RuntimeError as e:                       # a rank failed: the launcher says which and why
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    emit(format_table(report), report, args.json)
    return 0


def _validate(args) -> None:
    if any(n < 2 for n in args.world_size):
        raise UsageError("--world-size: every N must be >= 2 (PyTorch's peers need a group)")
    if args.steps < 2 or args.repeats < 1:
        raise UsageError("--steps must be >= 2 (the first is warm-up) and --repeats >= 1")
    if args.model not in MODEL_NAMES:
        raise UsageError(f"--model must be one of {', '.join(MODEL_NAMES)}, got {args.model!r}")
    if not set(args.stages) <= set(PEER_OF_STAGE):
        raise UsageError(f"--stages must be among 0 1 2 3, got {' '.join(map(str, args.stages))}")
    if any(16 % n for n in args.world_size):
        raise UsageError("--world-size: the batch of 16 rows must split evenly (N in 2, 4, 8, 16)")
