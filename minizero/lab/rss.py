"""Real memory under a real cap: a GPT whose DDP model states do not fit in a rank's memory. DDP
runs out of memory, stage 3 (and stage 3 + offload) trains in it, and each rank's measured resident
memory (RSS) stands next to the paper's formula.

    python -m minizero.scale --rss               # N = 4, 200 MB per rank (+ the baseline), ~1.5 min
    python -m minizero.scale --rss --rss-cap-mb 400 --world-size 2 --json rss.json

The cap is the kernel's: minizero.launch(..., memory_cap=bytes) sets each rank's RLIMIT_DATA
(launcher.py), so the allocation that crosses it fails in that rank, the launcher reports "rank r
failed: out of memory ..." in one line and stops the others. Nothing takes the machine's memory: the
kernel refuses address space before a page of it is touched, so a test can run this.

The statement, scaled down. On this 24 GB machine with N = 4 ranks, each has C = 6 GB: a GPT with
16Ψ > 6 GB (Ψ > 375 M; fp32 AdamW, 4 + 4 + 8 bytes per parameter) cannot train under DDP, which
holds 16Ψ on every rank, while stage 3 holds 16Ψ/N = 4Ψ = 1.5 GB plus what is in flight. Training
0.4 B parameters on 2 shared cores takes hours and four such ranks would fill the machine, so the
demo shrinks the machine instead: N × C is "the machine" (800 MB at the default C = 200 MB) and the
GPT is sized so that DDP's 16Ψ alone exceeds C by OVER (10 %). One term does not shrink: what a rank
holds whatever the model (~0.3 GB here: the interpreter, torch, gloo, the library code training
runs), 5 % of 6 GB but more than the demo's C. It is measured first (the baseline: a launch that
trains the tiny GPT), printed, and added to the cap: each rank's RLIMIT_DATA is the baseline's
private memory + C.

What to expect per rank, with L blocks (stage 3 gathers one block ahead, ~Ψ/L parameters each):
    DDP                16Ψ                  > C by construction: fails as AdamW creates its moments
    stage 3            16Ψ/N + in flight    two gathered blocks, one block's full gradients
    stage 3 + offload  24Ψ/N + in flight    + a host fp32 master and gradient partition (8Ψ/N): on a
                                            CPU
                                            the host *is* the device, so offloading saves
                                            nothing here
"above base" is the peak resident set (VmHWM) less the baseline's: model states, activations, and
the temporaries of autograd and gloo. It exceeds the formula by what is in flight, as
engine.memory()'s peak of model states ("engine peak") shows, and by those temporaries. Measured
(N = 4, C = 200 MB, a 13.9 M GPT, 2 cores shared with other jobs): DDP out of memory in 8 s; stage 3
98 MB above the baseline for a formula of 55 MB (engine peak 69 MB), stage 3 + offload 124 MB for 83
MB; ~80 s in all.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import gc
import time

from minizero import comm
from minizero.lab.model import GPTConfig, count_params
from minizero.lab.scale import WIDTH_STEP, largest
from minizero.lab.train import TrainConfig, state_bytes, train_worker
from minizero.launcher import launch
from minizero.memory import estimate_breakdown, optimizer_k

# (label, stage, offload): the replicated baseline and the fully sharded stage
VARIANTS = (("DDP", 0, False), ("stage 3", 3, False), ("stage 3 + offload", 3, True))
N_LAYER = 16    # more, smaller units: less gathered at once (stage 3's in-flight bytes ~ Ψ/N_LAYER)
OVER = 1.10     # DDP's model states exceed the cap by this factor
CAP_MB = 200    # per rank, beyond the baseline: the default GPT is then 14 M parameters
LR = 3e-4       # AdamW; the sorting task's 3e-3 overshoots on a model this wide
# AdamW creates its state in the first step: the second shows the steady peak
STEPS = 2
M_MMAP_THRESHOLD = -3   # glibc's mallopt parameter (malloc.h)
STATUS_KEYS = ("VmHWM", "VmRSS", "VmData")  # peak and current resident set, private writable memory


def proc_status() -> dict[str, int]:
    """This process's peak and current resident set and its private writable memory (what
    RLIMIT_DATA caps), in bytes, from /proc/self/status."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in STATUS_KEYS:
                out[key] = int(value.split()[0]) * 1024          # "233204 kB"
    return out


def _fixed_mmap_threshold() -> None:
    """glibc's malloc raises its mmap threshold to the size of each large block freed (up to 32 MB),
    so after stage 3 frees its first gathered unit, later units come from the heap, which keeps
    freed memory for reuse: the resident set grows by fragments nobody uses (+240 MB measured on
    a 55 M GPT). A fixed threshold gives every tensor over 128 KB its own mapping, returned to the
    OS when freed: RSS then follows what is live, which is what the formulas count."""
    _libc().mallopt(M_MMAP_THRESHOLD, 128 * 1024)


def release_freed_memory() -> None:
    """Collect garbage and hand the heap's free pages back to the OS (glibc's malloc_trim): what
    one run freed then neither swells the resident set of the runs after it nor lets them
    allocate from a warm heap. The bench calls it between runs, so every side starts from the
    same process state."""
    gc.collect()
    _libc().malloc_trim(0)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"))


def baseline_worker(cfgs: list[TrainConfig]) -> dict[str, int]:
    """Worker: what a rank holds that does not grow with the model: train the tiny GPT under each
    config, then read proc_status. The interpreter, torch and gloo, the library code training runs
    (pages of torch's shared libraries are resident once touched: ~30 MB), threads' stacks,
    allocator arenas."""
    _fixed_mmap_threshold()
    for cfg in cfgs:
        train_worker(cfg)
    return proc_status()


def capped_worker(cfg: TrainConfig) -> dict:
    """Worker: train_worker(cfg), then this rank's peak resident set."""
    _fixed_mmap_threshold()
    result = train_worker(cfg)
    return {
        "losses": result["losses"],
        "num_params": result["num_params"],
        "rank": comm.rank(),
        "model_states_peak": result["peak"] + result["memory"]["offloaded"],
        "status": proc_status(),
    }


def train_config(
    stage: int, offload: bool, world_size: int, mcfg: GPTConfig, steps: int
) -> TrainConfig:
    """`steps` AdamW steps of the GPT mcfg, one row per rank; stage 3 builds it sharded
    (minizero.sharded_init): built the usual way, every rank would hold all of it first."""
    return TrainConfig(
        stage=stage,
        offload=offload,
        world_size=world_size,
        steps=steps,
        batch_size=world_size,
        model_overrides=dataclasses.asdict(mcfg),
        lr=LR,
        sharded_init=stage == 3,
    )


def model_for(cap: float) -> GPTConfig:
    """The narrowest GPT (N_LAYER blocks, width a multiple of WIDTH_STEP) whose DDP model states,
    16Ψ, exceed the cap by OVER: one width past the widest that does not."""
    def config(k: int) -> GPTConfig:
        return GPTConfig(n_layer=N_LAYER, n_embd=k * WIDTH_STEP)
    k, _, _ = largest(lambda k: (16 * count_params(config(k)) < OVER * cap, {}))
    return config(k + 1)


def formula(num_params: int, world_size: int, stage: int, offload: bool) -> float:
    """The paper's model states per rank for fp32 AdamW, device and host together (on a CPU both
    are RAM)."""
    k = optimizer_k(state_bytes("adamw"), "fp32", offload)
    return sum(estimate_breakdown(num_params, world_size, stage, param_bytes=4, grad_bytes=4, k=k,
                                  offload=offload).values())


def capped_runs(cap_mb: float = CAP_MB, world_size: int = 4, steps: int = STEPS,
                mcfg: GPTConfig | None = None, variants=VARIANTS) -> dict:
    """{"cap_bytes", "limit_bytes", "world_size", "n_layer", "n_embd", "num_params", "baseline",
    "rows": [{variant, stage, offload, formula, trained, seconds, error | losses, rank,
    model_states_peak, peak_rss, above_baseline}]}: a baseline launch (the tiny GPT), then one
    launch per variant with each rank's RLIMIT_DATA at the baseline's private memory + cap_mb. mcfg:
    the GPT (default model_for(cap))."""
    cap = int(cap_mb * 1e6)
    tiny = [
        train_config(stage, offload, world_size, GPTConfig.named("tiny"), steps)
        for _, stage, offload in variants
    ]
    baseline = max(
        launch(baseline_worker, world_size, tiny, backend="gloo"), key=lambda s: s["VmData"]
    )
    limit = baseline["VmData"] + cap
    mcfg = mcfg or model_for(cap)
    psi = count_params(mcfg)
    rows = []
    for label, stage, offload in variants:
        row = {
            "variant": label,
            "stage": stage,
            "offload": offload,
            "formula": formula(psi, world_size, stage, offload),
        }
        start = time.perf_counter()
        try:
            ranks = launch(
                capped_worker,
                world_size,
                train_config(stage, offload, world_size, mcfg, steps),
                backend="gloo",
                memory_cap=limit,
            )
        except RuntimeError as e:
            rows.append({**row, "trained": False, "error": str(e).splitlines()[0],
                         "seconds": time.perf_counter() - start})
            continue
        top = max(ranks, key=lambda r: r["status"]["VmHWM"])
        # each rank: its rows
        losses = [sum(step) / world_size for step in zip(*(r["losses"] for r in ranks))]
        rows.append(
            {
                **row,
                "trained": True,
                "seconds": time.perf_counter() - start,
                "losses": losses,
                "rank": top["rank"],
                "model_states_peak": top["model_states_peak"],
                "peak_rss": top["status"]["VmHWM"],
                "above_baseline": top["status"]["VmHWM"] - baseline["VmHWM"],
            }
        )
    return {
        "mode": "rss",
        "cap_bytes": cap,
        "limit_bytes": limit,
        "world_size": world_size,
        "n_layer": mcfg.n_layer,
        "n_embd": mcfg.n_embd,
        "num_params": psi,
        "baseline": baseline,
        "rows": rows,
    }


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.0f} MB"


def format_rss_table(report: dict) -> str:
    n, cap, psi, base = (
        report["world_size"],
        report["cap_bytes"],
        report["num_params"],
        report["baseline"],
    )
    lines = [
        (
            f"N = {n} ranks, each capped at {_mb(cap)} beyond the baseline (RLIMIT_DATA "
            f"{_mb(report['limit_bytes'])} of private memory): "
            f"the 'machine' is N × cap = {_mb(n * cap)}"
        ),
        (
            f"GPT n_layer {report['n_layer']}, n_embd "
            f"{report['n_embd']}: Ψ = {psi / 1e6:.1f} M; fp32 AdamW: "
            f"DDP's model states, 16Ψ = {_mb(16 * psi)} per rank, exceed the cap"
        ),
        (
            "baseline (a rank that trained the tiny GPT): "
            f"peak RSS {_mb(base['VmHWM'])}, private memory "
            f"{_mb(base['VmData'])}"
        ),
        f"{'':18} {'formula':>9} {'engine peak':>12} {'peak RSS':>9} {'above base':>11}  result",
    ]
    for r in report["rows"]:
        head = f"{r['variant']:18} {_mb(r['formula']):>9}"
        if r["trained"]:
            losses = " -> ".join(f"{x:.3f}" for x in r["losses"])
            lines.append(
                f"{head} {_mb(r['model_states_peak']):>12} {_mb(r['peak_rss']):>9} "
                f"{_mb(r['above_baseline']):>11}  trained in {r['seconds']:.0f} s, loss {losses}"
            )
        else:
            lines.append(f"{head} {'-':>12} {'-':>9} {'-':>11}  failed in {r['seconds']:.0f} s")
    lines += [f"{r['variant']}: {r['error']}" for r in report["rows"] if not r["trained"]]
    lines.append(
        "formula: the paper's model states per rank, "
        "host and device (both RAM here); engine peak: "
        "engine.memory()'s, with what is in flight; peak "
        "RSS: the rank with the highest; loss: mean "
        "over ranks"
    )
    return "\n".join(lines)
