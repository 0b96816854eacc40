"""minizero against PyTorch's and DeepSpeed's implementation of every stage, at ~0.2M to
~50M parameters.

    python -m minizero.bench                                        # N = 2 and 4, the default model
    python -m minizero.bench --world-size 2 --sizes 1M,8M,50M --steps 6 --repeats 2 --json b.json
    python -m minizero.bench --peers torch                          # PyTorch's peers only
    python -m minizero.bench --device cuda                          # NCCL, one GPU per rank
    python -m minizero.bench --device cuda --dtype bf16             # minizero alone, bf16 MFU
    # where each side's time goes
    python -m minizero.bench --world-size 4 --sizes 8M --stages 2 --phases
    # the scale demo (minizero.scale)
    python -m minizero.bench --scale --budget-mb 4
    # ... its largest micro-batch per stage
    python -m minizero.bench --scale --micro-batch
    python -m minizero.bench --peak --world-size 2                  # the GEMM peak MFU divides by
    # gloo's collectives vs comm's (lab/collectives.py)
    python -m minizero.bench --collectives

Pairs (minizero.lab.peers builds PyTorch's side, minizero.lab.deepspeed_peer DeepSpeed's; both are
trained by the same loop as minizero.lab.train):
    stage 0        <->  torch DistributedDataParallel                          DeepSpeed stage 0
    stage 1        <->  ZeroRedundancyOptimizer (over DDP)                     DeepSpeed stage 1
    stage 2        <->  FSDP2 fully_shard per block + root, no reshard         DeepSpeed stage 2
    stage 3        <->  FSDP2 fully_shard per block + root                     DeepSpeed stage 3,
                                                                               blocks as leaves
    stage 2 + offload   (PyTorch has no optimizer offload without stage 3)     DeepSpeed
                                                                               offload_optimizer cpu
    fully_shard    <->  FSDP2 fully_shard per block + root (--stages fully_shard: minizero's front
                        end, both in PyTorch's loop)
    ddp            <->  torch's DistributedDataParallel (--stages ddp: minizero's, your optimizer)
    ddp+zero       <->  DDP + ZeroRedundancyOptimizer (--stages ddp+zero: minizero's pair)
Stage 3 gathers the same units on every side: minizero's default units are the GPT's blocks, FSDP2
is fully_shard-ed per block, DeepSpeed fetches each block at once (set_z3_leaf_modules). DeepSpeed
pairs run when it is installed (pip install -e ".[peers]"). Same GPT (--sizes:
minizero.lab.model.SIZES), initial weights, data, fp32, AdamW, world size, gloo on the CPU
(--device cuda: NCCL, one GPU per rank, so N = 1 on a machine with one GPU; at N = 1 a peer that
refuses a group of one is skipped, its reason in the report). The peers are built in fp32 only
(peers.build_peer and deepspeed_peer.ds_config refuse anything else): with --dtype bf16 minizero
runs alone, and its rows say so, rather than next to a peer at another precision.

How it is fair: one launch per world size runs every pair in the same processes; within a repeat
each configuration runs minizero and its peers back to back, in alternating order (A B C, then C B
A, ...), so a slow patch of a shared machine hits every side alike. A step's time is the slowest
rank's (collectives make every rank wait for it); the first step of every run is warm-up and
dropped; the ratio compares medians. Every rank computes with one intra-op thread, so every side
sees the same CPU.

Reported per pair: ratio = median step time minizero / peer (repeat_ratios: the same within each
repeat, how much it moves); per-rank model-state bytes (minizero's engine.memory(); the peers'
counted from their parameters, gradients and optimizer state by minizero.memory.measure); bytes sent
per step (minizero's tally; for the peers the ring formula of the collectives they issue: they keep
no tally); the largest |parameter difference| after the run; and the profile (--phases): the median
time of forward, backward (with the collectives it waits for) and the optimizer step (with what it
communicates) on each side, which says where a ratio comes from.

And what minizero's own measurement costs (the default run only, not with --sizes): engine(x)
runs the forward under the activation meter (beyond/activations.py: a saved-tensor hook per tensor
forward saves, engine.memory()["activations"]); `engine.module(x)` runs the same forward without
it. Both run the same loop (meter_worker), in alternating order like the pairs, and must end at
the same losses.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch

from minizero import comm
from minizero.lab import deepspeed_peer
from minizero.lab.model import GPTConfig, count_params, make_model
from minizero.lab.peers import (FRONT_ENDS, PEER_OF_STAGE, TENSOR_PARALLEL_PEER, front_end_worker,
                                peer_worker)
from minizero.lab.reference import max_abs_diff
from minizero.lab.rss import release_freed_memory
from minizero.lab.throughput import peak_worker, throughput
from minizero.lab.train import (
    TrainConfig,
    clock,
    forward_backward,
    progress_bar,
    train_worker,
)
from minizero.launcher import launch
from minizero.memory import comm_volume
from minizero.wrap import wrap

SIDES = ("minizero", "peer")
METER = ("meter on", "meter off")    # minizero with and without the activation meter (meter_worker)
MEMORY_KEYS = ("params", "grads", "optimizer", "offloaded")
DEVICE_KEYS = MEMORY_KEYS[:3]           # what stays on the compute device (offloaded: host memory)
VARIANTS = {
    "0": (0, False),
    "1": (1, False),
    "2": (2, False),
    "3": (3, False),
    "2+offload": (2, True),
}
# On request (--stages 3+tp2): stage 3 on a mesh of tensor-parallel rows of 2 ([Note: the 2-D mesh]
# in engine.py), next to PyTorch's TP + FSDP2 (peers.TENSOR_PARALLEL_PEER). Not by default: the
# tiny model's one head does not split.
TENSOR_PARALLEL_VARIANTS = {"3+tp2": (3, False, 2)}
# On request (--stages fully_shard ddp ddp+zero): a front end of minizero's next to the PyTorch
# implementation it imitates (peers.FRONT_ENDS), both in PyTorch's loop: minizero.fully_shard per
# block and at the root against torch's fully_shard the same way; minizero.DistributedDataParallel
# (and with its ZeroRedundancyOptimizer) against torch's. No activation meter (it is the engine's).
# Each is reported as the stage its peer stands for.
FRONT_END_VARIANTS = tuple(FRONT_ENDS)
ALL_VARIANTS = {**VARIANTS, **{v: spec[:2] for v, spec in TENSOR_PARALLEL_VARIANTS.items()},
                **{v: ({p: s for s, p in PEER_OF_STAGE.items()}[FRONT_ENDS[v]], False)
                   for v in FRONT_END_VARIANTS}}
PEER_FAMILIES = ("torch", "deepspeed")
PEER_DTYPE = "fp32"                          # the one precision the peer wrappers build
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}   # --device: one process per rank, on the CPU or a GPU
PHASES = ("forward", "backward", "step")     # minizero.lab.train.forward_backward and timed_step

# The collectives each PyTorch peer issues per step, each over the full Ψ (the ring bytes of
# comm.py). ZeroRedundancyOptimizer sits on DDP: a full all-reduce, then each rank broadcasts the
# partition it stepped (N broadcasts of Ψ/N: Ψ). That is 3Ψ where ZeRO stage 1 needs 2Ψ
# (reduce-scatter + all-gather). FSDP2 does not gather its root unit a second time for backward;
# the few root parameters are ignored. DeepSpeed implements the paper: 2Ψ at stages 0-2, 3Ψ at
# stage 3 (minizero.memory.comm_volume).
PEER_COLLECTIVES = {
    "ddp": ("all_reduce",),
    "zero_redundancy": ("all_reduce", "broadcast"),
    "fsdp2_no_reshard": ("all_gather", "reduce_scatter"),
    "fsdp2": ("all_gather", "all_gather", "reduce_scatter"),
}


def peer_comm_bytes(
    peer: str, num_params: int, world_size: int, stage: int = 0, bytes_per_elem: int = 4
) -> float:
    """Bytes one rank sends per step in a ring for `peer` at `stage` (fp32: 4 bytes per element)."""
    if peer == deepspeed_peer.PEER:
        return comm_volume(num_params, world_size, stage, bytes_per_elem=bytes_per_elem)
    if peer == TENSOR_PARALLEL_PEER:
        return float("nan")               # its blocks' all-reduces and FSDP2's: not modelled here
    full = num_params * bytes_per_elem
    return sum(comm.ring_bytes(kind, full, world_size) for kind in PEER_COLLECTIVES[peer])


def peers_of(variant: str, families=PEER_FAMILIES) -> list[str]:
    """The peers a variant is compared with: PyTorch's for its stage (none for offload), DeepSpeed
    if installed."""
    if variant in TENSOR_PARALLEL_VARIANTS:
        return [TENSOR_PARALLEL_PEER] if "torch" in families else []
    if variant in FRONT_END_VARIANTS:
        return [FRONT_ENDS[variant]] if "torch" in families else []
    stage, offload = VARIANTS[variant]
    out = [PEER_OF_STAGE[stage]] if "torch" in families and not offload else []
    if "deepspeed" in families and deepspeed_peer.available():
        out.append(deepspeed_peer.PEER)
    return out


def size_label(model: str) -> str:
    """'8M: 8 blocks of width 288, Ψ = 8,005,824': the shape behind a size's name, and its
    real Ψ."""
    cfg = GPTConfig.named(model)
    return f"{model}: {cfg.n_layer} blocks of width {cfg.n_embd}, Ψ = {count_params(cfg):,}"


# --------------------------------------------------------------------------------------------------
# Worker: every pair, every repeat, in one process group
# --------------------------------------------------------------------------------------------------

def meter_worker(cfg: TrainConfig, meter: bool) -> dict:
    """minizero's training loop (train_worker's, without its bookkeeping) with the activation meter
    on or off: step times, losses, the activations' peak."""
    engine = wrap(make_model(cfg.model_config(), seed=cfg.seed), cfg.stage, cfg.optimizer_factory(),
                  offload=cfg.offload, **cfg.engine_options())
    forward = engine if meter else engine.module          # engine(x) records what forward saves
    step_times, losses = [], []
    for step in range(cfg.steps):
        start = clock()
        losses.append(forward_backward(cfg, step, forward, engine.backward, engine.no_sync))
        engine.step()
        step_times.append(clock() - start)
    return {
        "step_times": step_times,
        "losses": losses,
        "activations": engine.memory()["activations"],
    }


def _run(impl: str, cfg: TrainConfig, front_end: str | None = None) -> dict:
    if impl == "minizero":
        return front_end_worker(cfg, front_end) if front_end else train_worker(cfg)
    if impl in METER:
        return meter_worker(cfg, impl == "meter on")
    if impl == deepspeed_peer.PEER:
        return deepspeed_peer.deepspeed_worker(cfg)
    return peer_worker(cfg, impl)


def bench_worker(jobs: list[tuple], repeats: int, meter: bool,
                 progress: bool = False) -> list[dict]:
    """Per (configuration, its peers[, minizero's front end, FRONT_END_VARIANTS]): step times of
    every repeat of every side (and of the engine with the activation meter on and off), memory
    and comm of the first repeat, and the max |minizero - peer| over all parameters after it
    (full state dicts, on this rank)."""
    torch.set_num_threads(1)
    out = []
    jobs = [(job[0], job[1], job[2] if len(job) > 2 else None) for job in jobs]
    for cfg, peers, front_end in jobs:
        impls = ["minizero", *peers] + (list(METER) if meter and not front_end else [])
        out.append({"impls": impls, "times": {impl: [] for impl in impls},
                    "phases": {impl: [] for impl in impls if impl not in METER}, "skipped": {}})
    bar = progress_bar(repeats * len(jobs), f"N = {comm.world_size()}",
                       progress and comm.rank() == 0, unit="config")
    for rep in range(repeats):
        for (cfg, peers, front_end), record in zip(jobs, out):
            bar.update()
            run_cfg = dataclasses.replace(cfg, return_state=rep == 0)
            results = {}
            for impl in record["impls"] if rep % 2 == 0 else record["impls"][::-1]:
                release_freed_memory()          # the last run's memory back to the OS (lab/rss.py)
                comm.barrier()                  # every side starts from the same line
                try:
                    job_cfg = cfg if impl in METER else run_cfg
                    results[impl] = (_run(impl, job_cfg, front_end) if front_end
                                     else _run(impl, job_cfg))
                except Exception as e:
                    if not _may_skip(impl):
                        raise
                    record["skipped"][impl] = _reason(e)
                    continue
                record["times"][impl].append(results[impl]["step_times"])
                if impl not in METER:
                    record["phases"][impl].append(results[impl]["phase_times"])
            for impl in record["skipped"]:      # the pair is dropped: no partial repeats
                record["impls"] = [i for i in record["impls"] if i != impl]
                record["times"].pop(impl, None)
                record["phases"].pop(impl, None)
            peers = [p for p in peers if p not in record["skipped"]]
            if rep > 0:
                continue
            if meter and not front_end:
                record["meter_losses"] = {m: results[m]["losses"] for m in METER}
                record["meter_activations"] = {m: results[m]["activations"] for m in METER}
            mz = results["minizero"]
            state = mz.pop("state_dict")
            record["max_param_diff"] = {
                p: max_abs_diff(state, results[p].pop("state_dict")) for p in peers
            }
            record["num_params"] = mz["num_params"]
            record["memory"] = {impl: results[impl]["memory"] for impl in ["minizero", *peers]}
            record["peak"] = mz["peak"]
            record["comm"] = mz["comm_bytes_per_step"]["total"]
            record["final_loss"] = {
                impl: results[impl]["losses"][-1] for impl in ["minizero", *peers]
            }
    bar.close()
    # MFU's peak at each run's dtype: every rank's GEMM at once (one thread each on the CPU)
    peaks = {dtype: peak_worker(dtype) for dtype in sorted({cfg.dtype for cfg, _, _ in jobs})}
    device = comm.device()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    for (cfg, _, _), record in zip(jobs, out):
        record["gemm_flops_per_s"] = peaks[cfg.dtype]
        record["device_name"] = name
    return out


def _may_skip(impl: str) -> bool:
    """Whether a run of `impl` that raised is skipped (its reason reported) rather than failing the
    launch: a peer's, at N = 1 only. With more ranks the others would wait for this one inside
    the peer's collectives until the timeout; the launcher's one-line failure says more."""
    return comm.world_size() == 1 and impl not in ("minizero", *METER)


def _reason(e: Exception) -> str:
    """An exception in one short line: its type and the first line of its message."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first[:200]}"


# --------------------------------------------------------------------------------------------------
# Parent: one launch per world size, then the table
# --------------------------------------------------------------------------------------------------

def compare(world_sizes=(2, 4), *, sizes=("default",), steps: int = 10, repeats: int = 3,
            variants=tuple(VARIANTS), peers=PEER_FAMILIES, meter: bool = True, batch_size: int = 16,
            device: str = "cpu", dtype: str = PEER_DTYPE, progress: bool = False) -> dict:
    """{"config": ..., "pairs": [one record per (N, size, variant, peer)], "alone": [minizero's
    record per (N, size, variant) that no peer ran next to, with the reason], "skipped": [the
    peers that refused N = 1, with their reason], "meter": [one per (N, size, variant)] when
    meter}; see the module docstring for the fields. device: "cpu" (gloo) or "cuda" (NCCL, one GPU
    per rank); dtype: minizero's (TrainConfig.dtype); the peers run only at PEER_DTYPE."""
    backend = BACKENDS[device]
    pairs, alone, skipped, meters, device_name = [], [], [], [], None
    for n in world_sizes:
        jobs = []
        for size in sizes:
            for v in variants:
                stage, offload = ALL_VARIANTS[v]
                cfg = TrainConfig(
                    stage=stage,
                    offload=offload,
                    tensor_parallel=TENSOR_PARALLEL_VARIANTS.get(v, (0, 0, 1))[2],
                    world_size=n,
                    steps=steps,
                    model=size,
                    batch_size=batch_size,
                    dtype=dtype,
                    backend=backend,
                )
                jobs.append((cfg, peers_of(v, peers) if dtype == PEER_DTYPE else [], v))
        front_ends = [v if v in FRONT_END_VARIANTS else None for _, _, v in jobs]
        per_rank = launch(bench_worker, n,
                          [(cfg, ps, fe) for (cfg, ps, _), fe in zip(jobs, front_ends)],
                          repeats, meter, progress, backend=backend)
        device_name = per_rank[0][0]["device_name"]
        for out, records in zip((pairs, alone, skipped, meters), _records(jobs, per_rank, meter)):
            out += records
    report = {
        "config": {
            "world_sizes": list(world_sizes),
            "sizes": {s: count_params(GPTConfig.named(s)) for s in sizes},
            "steps": steps,
            "repeats": repeats,
            "batch_size": batch_size,
            "device": device,
            "gpu": device_name,                     # torch.cuda.get_device_name on rank 0's GPU
            "backend": backend,
            "dtype": dtype,
            "peer_dtype": PEER_DTYPE,
            "optimizer": "adamw",
            "threads_per_rank": 1,
            "peers": list(peers),
            "deepspeed": deepspeed_peer.available(),
        },
        "pairs": pairs,
        "alone": alone,
        "skipped": skipped,
    }
    if meter:
        report["meter"] = meters
    return report


def _records(jobs: list, per_rank: list[list[dict]], meter: bool) -> tuple[list, ...]:
    """One launch's (pairs, alone, skipped, meter) records from every rank's bench_worker result;
    jobs: (cfg, peers, variant) in the order the worker ran them."""
    pairs, alone, skipped, meters = [], [], [], []
    for i, (cfg, ps, v) in enumerate(jobs):
        ranks = [rank_records[i] for rank_records in per_rank]
        refused = ranks[0]["skipped"]          # N = 1 only (_may_skip): one rank
        skipped += [{"world_size": cfg.world_size, "size": cfg.model, "variant": v, "peer": p,
                     "reason": why} for p, why in refused.items()]
        ran = [p for p in ps if p not in refused]
        pairs += [_pair_record(cfg, v, p, ranks) for p in ran]
        if not ran:
            alone.append(_alone_record(cfg, v, _alone_reason(cfg, refused), ranks))
        if meter and v not in FRONT_END_VARIANTS:
            meters.append(_meter_record(cfg, v, ranks))
    return pairs, alone, skipped, meters


def _alone_reason(cfg: TrainConfig, refused: dict[str, str]) -> str:
    """Why a configuration has no pair: the table's last column for minizero's lone row."""
    if cfg.dtype != PEER_DTYPE:
        return f"the peers run in {PEER_DTYPE} only"
    if refused:
        return "; ".join(f"{peer} refused N = 1" for peer in refused)
    return "no peer among --peers for this variant"


def _one_side(cfg: TrainConfig, ranks: list[dict], impl: str) -> dict:
    """One implementation's figures in a launch: its median step time (the slowest rank's),
    throughput against the ranks' summed GEMM peak, profile by phase, and each rank's memory."""
    median = statistics.median(_slowest_rank_steps(ranks, impl))
    return {
        "step_time_s": median,
        "throughput": throughput(cfg.model_config(), cfg.batch_size, median, cfg.world_size,
                                 sum(r["gemm_flops_per_s"] for r in ranks)),
        "phase_s": {phase: statistics.median(_slowest_rank_steps(ranks, impl, phase))
                    for phase in PHASES},
        "memory": [{k: r["memory"][impl].get(k, 0) for k in MEMORY_KEYS} for r in ranks],
    }


def _pair_record(cfg: TrainConfig, variant: str, peer: str, ranks: list[dict]) -> dict:
    first = ranks[0]
    sides = {side: _one_side(cfg, ranks, impl) for side, impl in zip(SIDES, ("minizero", peer))}
    medians = {side: sides[side]["step_time_s"] for side in SIDES}
    psi = first["num_params"]
    return {
        "world_size": cfg.world_size, "size": cfg.model, "num_params": psi, "variant": variant,
        "stage": cfg.stage, "offload": bool(cfg.offload), "peer": peer,
        "step_time_s": medians,
        "ratio": medians["minizero"] / medians["peer"],
        # the same ratio within each repeat: how far the ratio moves from one repeat to the next
        "repeat_ratios": [
            statistics.median(mine) / statistics.median(theirs)
            for mine, theirs in zip(
                _slowest_rank_repeats(ranks, "minizero"), _slowest_rank_repeats(ranks, peer)
            )
        ],
        # tokens/s, FLOP/s and MFU of each side against the ranks' summed GEMM peak
        **{key: {side: sides[side][key] for side in SIDES}
           for key in ("throughput", "phase_s", "memory")},
        "minizero_peak": [r["peak"] for r in ranks],
        "comm_bytes_per_step": {"minizero": first["comm"],
                                "peer": peer_comm_bytes(peer, psi, cfg.world_size, cfg.stage)},
        "max_param_diff": max(r["max_param_diff"][peer] for r in ranks),
        "final_loss": {
            "minizero": first["final_loss"]["minizero"],
            "peer": first["final_loss"][peer],
        },
    }


def _alone_record(cfg: TrainConfig, variant: str, reason: str, ranks: list[dict]) -> dict:
    """minizero's side of a pair without its peer: step time, throughput, profile, memory, comm."""
    first = ranks[0]
    return {
        "world_size": cfg.world_size, "size": cfg.model, "num_params": first["num_params"],
        "variant": variant, "stage": cfg.stage, "offload": bool(cfg.offload), "dtype": cfg.dtype,
        "reason": reason,
        **_one_side(cfg, ranks, "minizero"),
        "minizero_peak": [r["peak"] for r in ranks],
        "comm_bytes_per_step": first["comm"],
        "final_loss": first["final_loss"]["minizero"],
    }


def _meter_record(cfg: TrainConfig, variant: str, ranks: list[dict]) -> dict:
    """The activation meter: minizero's step time with it on and off, what it saw, the losses
    of both."""
    first = ranks[0]
    medians = {m: statistics.median(_slowest_rank_steps(ranks, m)) for m in METER}
    return {"world_size": cfg.world_size, "size": cfg.model, "variant": variant, "stage": cfg.stage,
            "step_time_s": {m.split()[1]: medians[m] for m in METER},
            "cost": medians["meter on"] / medians["meter off"] - 1,
            "activations": {
                m.split()[1]: [r["meter_activations"][m] for r in ranks] for m in METER
            },
            "losses": {m.split()[1]: first["meter_losses"][m] for m in METER}}


def _slowest_rank_repeats(
    ranks: list[dict], impl: str, phase: str | None = None
) -> list[list[float]]:
    """Per repeat, each step's time (or one phase's: PHASES) on its slowest rank, warm-up steps (the
    first of every run) dropped."""
    out = []
    runs = (
        r["times"][impl]
        if phase is None
        else [[t[phase] for t in run] for run in r["phases"][impl]]
        for r in ranks
    )
    for per_rank_runs in zip(*runs):
        steps = [max(ts) for ts in zip(*per_rank_runs)]
        out.append(steps[1:] or steps)
    return out


def _slowest_rank_steps(ranks: list[dict], impl: str, phase: str | None = None) -> list[float]:
    """_slowest_rank_repeats, all repeats in one list."""
    return [t for repeat in _slowest_rank_repeats(ranks, impl, phase) for t in repeat]


def format_table(report: dict, phases: bool = False) -> str:
    def mb(x: float) -> str:
        return f"{x / 1e6:9.3f}"
    c = report["config"]
    ds = (
        ""
        if c["deepspeed"] or "deepspeed" not in c["peers"]
        else " (DeepSpeed not installed: pip install -e '.[peers]')"
    )
    gpu = f" ({c['gpu']})" if c["gpu"] else ""
    lines = [
        (
            f"minizero vs its peers{ds}, {c['steps']} steps "
            f"x {c['repeats']} repeats, {c['backend']} on {c['device']}{gpu}, "
            f"{c['dtype']} AdamW, batch {c['batch_size']}; rank "
            "0's device model states and bytes sent per step in MB"
        )
    ]
    lines += ["  " + size_label(s) for s in c["sizes"]]
    if report["pairs"]:
        lines.append(
            f"{'N':>2} {'size':>7} {'stage':>9} {'peer':<17}{'mz ms':>9}{'peer ms':>9}{'ratio':>7}"
            f"{'mz tok/s':>10}{'mz MFU':>8}{'peer MFU':>9}"
            f"{'mz dev':>10}{'peer dev':>10}{'mz comm':>10}{'peer comm':>10}{'max |Δp|':>10}"
        )
        for p in report["pairs"]:
            dev = {side: sum(p["memory"][side][0][k] for k in DEVICE_KEYS) for side in SIDES}
            lines.append(
                f"{p['world_size']:>2} {p['size']:>7} {p['variant']:>9} {p['peer']:<17}"
                f"{p['step_time_s']['minizero'] * 1e3:9.1f}{p['step_time_s']['peer'] * 1e3:9.1f}"
                f"{p['ratio']:7.2f}{p['throughput']['minizero']['tokens_per_s']:10,.0f}"
                f"{p['throughput']['minizero']['mfu']:8.1%}"
                f"{p['throughput']['peer']['mfu']:9.1%}"
                f" {mb(dev['minizero'])} {mb(dev['peer'])}"
                f" {mb(p['comm_bytes_per_step']['minizero'])}"
                f" {mb(p['comm_bytes_per_step']['peer'])}"
                f"{p['max_param_diff']:10.1e}"
            )
        lines.append("ratio = median step time minizero / peer (< 1: minizero faster). Peer comm: "
                     "ring formula of its collectives.")
    if report["alone"]:
        lines.append("")
        lines.append(f"minizero alone, {c['dtype']}: no peer ran next to these (why: last column)")
        lines.append(f"{'N':>2} {'size':>7} {'stage':>9}{'mz ms':>9}{'mz tok/s':>10}{'mz MFU':>8}"
                     f"{'mz dev':>10}{'mz comm':>10}  why")
        for a in report["alone"]:
            dev = sum(a["memory"][0][k] for k in DEVICE_KEYS)
            lines.append(
                f"{a['world_size']:>2} {a['size']:>7} {a['variant']:>9}"
                f"{a['step_time_s'] * 1e3:9.1f}{a['throughput']['tokens_per_s']:10,.0f}"
                f"{a['throughput']['mfu']:8.1%} {mb(dev)} {mb(a['comm_bytes_per_step'])}"
                f"  {a['reason']}"
            )
    for s in report["skipped"]:
        lines.append(f"skipped at N = {s['world_size']}: {s['peer']} for stage {s['variant']} "
                     f"({s['size']}): {s['reason']}")
    lines.append("dev: params + grads + optimizer on the compute device (offloaded: host).")
    lines.append("tok/s: tokens per second, all ranks; MFU: model FLOPs per second (6Ψ + attention "
                 f"per token) over the ranks' summed GEMM peak at the run's dtype ({c['dtype']}; "
                 "minizero/lab/throughput.py)")
    if phases:
        lines.append("")
        lines.append(
            "where the time goes: median ms of each phase on the slowest rank, minizero / peer "
            "(backward includes the collectives it waits for; "
            "step: the optimizer step and what it communicates)"
        )
        lines.append(
            f"{'N':>2} {'size':>7} {'stage':>9} {'peer':<17}"
            + "".join(f"{ph:>18}" for ph in PHASES)
        )
        for p in report["pairs"]:
            mz, peer = p["phase_s"]["minizero"], p["phase_s"]["peer"]
            lines.append(f"{p['world_size']:>2} {p['size']:>7} {p['variant']:>9} {p['peer']:<17}"
                         + "".join(f"{mz[ph] * 1e3:9.1f} /{peer[ph] * 1e3:7.1f}" for ph in PHASES))
    if "meter" in report:
        lines.append("")
        lines.append(
            "the activation meter (engine(x) vs engine.module(x), "
            "same loop): minizero's median step time"
        )
        lines.append(f"{'N':>2} {'stage':>9}{'on ms':>8}{'off ms':>8}{'cost':>8}{'activ. kB':>11}")
        for m in report["meter"]:
            lines.append(
                f"{m['world_size']:>2} {m['variant']:>9}{m['step_time_s']['on'] * 1e3:8.2f}"
                f"{m['step_time_s']['off'] * 1e3:8.2f}{m['cost'] * 100:7.1f}%"
                f"{m['activations']['on'][0] / 1e3:11.1f}"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# Muon (beyond/muon/): its step against AdamW's, and against DeepSpeed's Muon
# --------------------------------------------------------------------------------------------------
# python -m minizero.bench --muon. Each (size, stage) trains the same GPT three ways in one launch,
# back to back in alternating order as the pairs above: minizero with AdamW, minizero with Muon
# (TrainConfig "muon": DeepSpeed's reading of a Muon config, so both Muon sides split the model
# alike: the matrices not named embed or lm_head; minizero's GPT calls its embeddings tok_emb and
# pos_emb, so they are Muon's too), and DeepSpeed's Muon (eagerly: deepspeed_peer.build).
MUON_IMPLS = ("adamw", "muon", "deepspeed muon")
MUON_LR, MUON_PARAMS = 0.02, {"adam_lr": 3e-3}


def muon_configs(cfg: TrainConfig) -> dict[str, TrainConfig]:
    """The three runs of one (size, stage): MUON_IMPLS -> its TrainConfig."""
    muon = dataclasses.replace(cfg, optimizer="muon", lr=MUON_LR, optimizer_params=MUON_PARAMS)
    return {"adamw": cfg, "muon": muon, "deepspeed muon": muon}


def muon_worker(cfgs: list[TrainConfig], repeats: int) -> list[dict]:
    """Per configuration: every repeat's step times of each impl (DeepSpeed's where installed),
    and from the first repeat the final losses and max |minizero - DeepSpeed| over the
    parameters."""
    torch.set_num_threads(1)
    impls = [i for i in MUON_IMPLS if i != "deepspeed muon" or deepspeed_peer.available()]
    out = []
    for cfg in cfgs:
        runs = muon_configs(cfg)
        record = {"times": {impl: [] for impl in impls}, "final_loss": {}}
        for rep in range(repeats):
            states = {}
            for impl in impls if rep % 2 == 0 else impls[::-1]:
                release_freed_memory()
                comm.barrier()
                run_cfg = dataclasses.replace(runs[impl], return_state=rep == 0)
                result = (deepspeed_peer.deepspeed_worker(run_cfg) if impl == "deepspeed muon"
                          else train_worker(run_cfg))
                record["times"][impl].append(result["step_times"])
                if rep == 0:
                    record["final_loss"][impl] = result["losses"][-1]
                    states[impl] = result["state_dict"]
            if rep == 0 and "deepspeed muon" in states:
                record["max_param_diff"] = max_abs_diff(states["muon"], states["deepspeed muon"])
        out.append(record)
    return out


def compare_muon(world_size: int = 2, sizes=("1M", "8M"), stages=(1, 2, 3), steps: int = 6,
                 repeats: int = 2, batch_size: int = 16) -> dict:
    """{"config", "rows": one per (size, stage): median step time of each impl (the slowest
    rank's, warm-up dropped), muon / adamw and muon / deepspeed muon, final losses, max |Δp|}."""
    cfgs = [TrainConfig(stage=stage, world_size=world_size, steps=steps, model=size,
                        batch_size=batch_size) for size in sizes for stage in stages]
    ranks = launch(muon_worker, world_size, cfgs, repeats)
    rows = []
    for i, cfg in enumerate(cfgs):
        per_rank = [r[i] for r in ranks]
        medians = {impl: statistics.median(_slowest_rank_steps(per_rank, impl))
                   for impl in per_rank[0]["times"]}
        rows.append({"size": cfg.model, "stage": cfg.stage, "step_time_s": medians,
                     "muon/adamw": medians["muon"] / medians["adamw"],
                     "muon/deepspeed": (medians["muon"] / medians["deepspeed muon"]
                                        if "deepspeed muon" in medians else None),
                     "final_loss": per_rank[0]["final_loss"],
                     "max_param_diff": per_rank[0].get("max_param_diff")})
    return {"config": {"world_size": world_size, "steps": steps, "repeats": repeats,
                       "batch_size": batch_size, "sizes": {s: count_params(GPTConfig.named(s))
                                                           for s in sizes},
                       "muon_lr": MUON_LR, "muon_params": MUON_PARAMS, "threads_per_rank": 1,
                       "deepspeed": deepspeed_peer.available()},
            "rows": rows}


def format_muon_table(report: dict) -> str:
    c = report["config"]
    lines = [f"Muon (lr {c['muon_lr']}, AdamW beside it: {c['muon_params']}) against AdamW (lr "
             f"3e-3) and DeepSpeed's Muon, N = {c['world_size']}, {c['steps']} steps x "
             f"{c['repeats']} repeats, gloo, fp32, batch {c['batch_size']}; median step ms of the "
             "slowest rank"]
    lines += ["  " + size_label(s) for s in c["sizes"]]
    lines.append(f"{'size':>5} {'stage':>5}{'AdamW':>9}{'Muon':>9}{'DS Muon':>9}"
                 f"{'Muon/AdamW':>12}{'Muon/DS':>9}{'max |Δp| vs DS':>16}")
    for r in report["rows"]:
        t = r["step_time_s"]
        ds = t.get("deepspeed muon")
        lines.append(f"{r['size']:>5} {r['stage']:>5}{t['adamw'] * 1e3:9.1f}{t['muon'] * 1e3:9.1f}"
                     + (f"{ds * 1e3:9.1f}" if ds else f"{'-':>9}")
                     + f"{r['muon/adamw']:12.2f}"
                     + (f"{r['muon/deepspeed']:9.2f}{r['max_param_diff']:16.1e}" if ds else ""))
    if not c["deepspeed"]:
        lines.append("(DeepSpeed not installed: pip install -e '.[peers]')")
    lines.append("Muon/DS > 1: minizero's Muon slower. |Δp|: torch's bf16 Newton-Schulz against "
                 "DeepSpeed's fp32 Gram one (docs/muon.md).")
    return "\n".join(lines)
