"""ZeRO-Infinity's disk tier at full size: a 1.5B-parameter GPT on a machine that cannot hold it.

    python -m minizero.scale --infinity                  # GPT-2 XL's shape, N = 2: 15 min here
    python -m minizero.scale --infinity --layers 4 --cap-gb 2     # ~120M parameters, ~2 min

GPT-2 XL's shape (48 blocks of width 1600, the lab's 12-token vocabulary): Ψ = 1.476 × 10^9.
Trained in bf16 with AdamW its model states are 16Ψ = 23.6 GB: this whole machine, before the
activations, the interpreter or anything else. Each variant runs N = 2 ranks, activation
checkpointing on, the model built with minizero.sharded_init (stage 3) or the usual way (DDP),
under a cap of --cap-gb of private memory per rank (RLIMIT_DATA: minizero.launch(memory_cap=...),
as lab/rss.py does):

    DDP              16Ψ a rank     stops while it builds the model: the launcher's one line
    stage 3          16Ψ/N a rank   stops when AdamW's state is created (the fp32 master first)
    stage 3 + disk   4Ψ/N a rank    the 12Ψ/N of optimizer state in a file (beyond/disk.py): trains

The kernel refuses the allocation that crosses the cap, so a run that cannot fit fails in its own
rank, in one line, and never wakes the kernel's OOM killer for the machine's other jobs. For the
disk run, per rank: the peak resident set (VmHWM) next to 4Ψ/N; the file's bytes and what it reads
and writes per step next to KΨ/N (memory.estimate_breakdown, memory.disk_traffic); the bandwidth
the pipeline achieved (bytes moved / seconds of engine.step(), and inside the I/O thread's calls)
next to a raw sequential write and read of the same bytes by the same file code, both ranks at
once (the physical limit); step time, tokens/s, and MFU (6Ψ per token) against a bf16 matmul
timed on the rank's core in the same run.

Measured here (N = 2, cap 6.5 GB a rank, nothing else running; 271 s in all): DDP out of memory in
33 s, stage 3 in 53 s; stage 3 + disk trained 3 steps in 186 s, the loss falling 2.700 -> 2.603 ->
2.408 (every step trains on the same batch, so three steps show the optimizer at work), at a peak
RSS of 3.61 GB a rank (formula 2.95 GB: the interpreter and torch add ~0.4 GB, then activations and
gathered units), its 8.85 GB file read and written once a step (= KΨ/N, the formula), 0.82 GB/s
over engine.step(), more than the 0.67 GB/s a plain write-then-read of the same file reached beside
it (write 1.05, read 0.49 GB/s a rank, both ranks at once: the pipeline reads and writes at once);
36-39 s a step, engine.step() 20-24 s of it. An earlier run at LR 2e-5 on a loaded machine (505 s
for the 3 steps, 15 min in all) saw the loss rise: Adam's first steps move every weight by about
LR whatever its gradient, too far across 48 blocks of width 1600; LR is 3e-6 since.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
import time

import torch

from minizero import comm
from minizero.cli import OneLineParser, UsageError, add_json_flag, emit, fail
from minizero.beyond.disk import ALIGN, IO_CHUNK, ScratchFile, aligned_buffer, check_folder
from minizero.lab.data import sequence_length
from minizero.lab.model import GPTConfig, count_params
from minizero.lab.rss import _fixed_mmap_threshold, proc_status
from minizero.lab.train import TrainConfig, train_worker
from minizero.launcher import launch
from minizero.memory import disk_traffic, estimate_breakdown
from minizero.wrap import wrap

N_LAYER, N_EMBD, N_HEAD = 48, 1600, 25      # GPT-2 XL
BLOCK_SIZE = 64                             # tokens a row
ROWS = 2                                    # rows a rank computes per step
STEPS = 3
CAP_GB = 6.5                                # private memory a rank may hold (both: 13 of 24 GB)
VARIANTS = (("DDP", 0, False), ("stage 3", 3, False), ("stage 3 + disk", 3, "disk"))
LR = 3e-6
# torch's fused CPU AdamW: ~4x its single-tensor path here (DeepSpeed has its own CPU Adam, too)
OPTIMIZER_PARAMS = {"fused": True}
K = 12                                      # bf16 AdamW: fp32 master + two moments


def model_config(layers: int = N_LAYER) -> GPTConfig:
    return GPTConfig(n_layer=layers, n_embd=N_EMBD, n_head=N_HEAD, block_size=BLOCK_SIZE)


def train_config(stage: int, offload, layers: int, world_size: int, folder: str) -> TrainConfig:
    return TrainConfig(stage=stage, offload=offload, offload_path=folder if offload else None,
                       world_size=world_size, steps=STEPS, batch_size=ROWS * world_size,
                       dtype="bf16", lr=LR, optimizer_params=OPTIMIZER_PARAMS,
                       model_overrides=dataclasses.asdict(model_config(layers)),
                       sharded_init=stage == 3, activation_checkpointing=True,
                       fixed_batch=True)       # one batch: three steps show the loss falling


def raw_bandwidth(folder: str, nbytes: int) -> dict:
    """Collective: every rank writes, then reads, `nbytes` in order through a ScratchFile (the
    disk tier's own calls, one IO_CHUNK buffer), all ranks at once as in training. Bytes/s."""
    nbytes = -(-nbytes // ALIGN) * ALIGN
    file = ScratchFile(folder, nbytes)
    buffer = aligned_buffer(min(IO_CHUNK, nbytes))
    buffer.random_(0, 256)
    out = {}
    for what, call in (("write", file.write), ("read", file.read)):
        comm.barrier()
        start = time.perf_counter()
        for offset in range(0, nbytes, buffer.numel()):
            call(buffer[: min(buffer.numel(), nbytes - offset)], offset)
        out[what] = nbytes / (time.perf_counter() - start)
    file.close()
    return out


def matmul_flops(size: int = 2048, repeats: int = 8) -> float:
    """FLOP/s of a bf16 matmul on this rank's threads: the peak its MFU is measured against."""
    a = torch.randn(size, size, dtype=torch.bfloat16)
    a @ a
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def capped_worker(cfg: TrainConfig) -> dict:
    """Worker: train cfg (the disk run times the raw disk and a matmul first); its figures."""
    _fixed_mmap_threshold()
    out = {"rank": comm.rank()}
    built = {}

    def make_engine(*args, **kwargs):          # train_worker's engine, kept to read its counters
        built["engine"] = wrap(*args, **kwargs)
        if cfg.offload == "disk":              # from here on: what the steps read and write
            built["at_start"] = _counters(built["engine"].optimizer.file)
        return built["engine"]

    if cfg.offload == "disk":
        psi = count_params(cfg.model_config())
        out["raw"] = raw_bandwidth(cfg.offload_path, int(K * psi / cfg.world_size))
        out["peak_flops"] = matmul_flops()
    result = train_worker(cfg, make_engine)
    for key in ("losses", "step_times", "phase_times", "memory", "num_params"):
        out[key] = result[key]
    out["status"] = proc_status()
    if cfg.offload == "disk":
        optimizer = built["engine"].optimizer
        now = _counters(optimizer.file)
        out["disk"] = {"file": optimizer.file.allocated(), "pieces": len(optimizer.pieces),
                       **{key: now[key] - built["at_start"][key] for key in now}}
    return out


def _counters(file: ScratchFile) -> dict:
    return {"read": file.read_bytes, "written": file.written_bytes,
            "read_seconds": file.read_seconds, "write_seconds": file.write_seconds}


def run(layers: int = N_LAYER, cap_gb: float = CAP_GB, world_size: int = 2,
        folder: str | None = None) -> dict:
    """Every variant under the cap: {"rows": [...], ...}, what format_report prints."""
    folder = folder or tempfile.gettempdir()
    psi = count_params(model_config(layers))
    cap = int(cap_gb * 1e9)
    rows = []
    for label, stage, offload in VARIANTS:
        formula = estimate_breakdown(psi, world_size, stage, k=K, offload=offload)
        row = {"variant": label, "stage": stage, "offload": offload, "formula": formula}
        start = time.perf_counter()
        cfg = train_config(stage, offload, layers, world_size, folder)
        try:
            row["ranks"] = launch(capped_worker, world_size, cfg, backend="gloo", memory_cap=cap)
            row["trained"] = True
        except RuntimeError as e:
            row.update(trained=False, error=str(e).splitlines()[0])
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
    return {"mode": "infinity", "num_params": psi, "n_layer": layers, "n_embd": N_EMBD,
            "world_size": world_size, "cap_bytes": cap, "folder": folder, "steps": STEPS,
            "tokens_per_step": ROWS * world_size * sequence_length(BLOCK_SIZE), "rows": rows}


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def format_report(report: dict) -> str:
    psi, n, cap = report["num_params"], report["world_size"], report["cap_bytes"]
    lines = [(f"GPT n_layer {report['n_layer']}, n_embd {report['n_embd']}: Ψ = {psi / 1e9:.3f} B, "
              f"bf16 AdamW, activation checkpointing, N = {n}; 16Ψ = {_gb(16 * psi)}"),
             (f"each rank capped at {_gb(cap)} of private memory (RLIMIT_DATA): "
              f"{_gb(n * cap)} in all")]
    for r in report["rows"]:
        f = r["formula"]
        ram = f["params"] + f["grads"] + f["optimizer"] + f["offloaded"]
        head = f"{r['variant']:15} needs {_gb(ram)} a rank in memory"
        head += f" + {_gb(f['disk'])} on disk" if f["disk"] else ""
        if not r["trained"]:
            lines.append(f"{head}: {r['error']} ({r['seconds']:.0f} s)")
            continue
        losses = [sum(step) / n for step in zip(*(x["losses"] for x in r["ranks"]))]
        lines.append(f"{head}: trained {report['steps']} steps in {r['seconds']:.0f} s, loss "
                     + " -> ".join(f"{x:.4f}" for x in losses))
        for x in r["ranks"]:
            lines += _rank_lines(report, x, ram, f["disk"])
    lines.append("formula: memory.estimate_breakdown (bf16: 2 + 2 bytes, K = 12); the RSS adds the "
                 "interpreter and torch (~0.4 GB), activations and gathered units")
    return "\n".join(lines)


def _rank_lines(report: dict, x: dict, ram: float, disk: float) -> list[str]:
    m, status = x["memory"], x["status"]
    lines = [(f"  rank {x['rank']}: peak RSS {_gb(status['VmHWM'])}, private "
              f"{_gb(status['VmData'])} (formula {_gb(ram)}); engine: params {_gb(m['params'])}, "
              f"grads {_gb(m['grads'])}, optimizer in memory {_gb(m['optimizer'])}")]
    if "disk" not in x:
        return lines
    d, raw = x["disk"], x["raw"]
    steps, step_s = len(x["step_times"]), [p["step"] for p in x["phase_times"]]
    each_way = disk_traffic(report["num_params"], report["world_size"], k=K)["read"]
    moved = d["read"] + d["written"]
    achieved = moved / sum(step_s)
    in_calls = moved / (d["read_seconds"] + d["write_seconds"])
    physical = 2 / (1 / raw["read"] + 1 / raw["write"])           # the same bytes each way
    seconds = sum(x["step_times"]) / steps
    flops = 6 * x["num_params"] * report["tokens_per_step"] / report["world_size"]   # this rank's
    times = ", ".join(f"{t:.1f}" for t in x["step_times"])
    lines.append(f"    disk: file {_gb(d['file'])} (KΨ/N {_gb(disk)}, {d['pieces']} pieces); per "
                 f"step read {_gb(d['read'] / steps)}, written {_gb(d['written'] / steps)} "
                 f"(formula {_gb(each_way)} each way)")
    lines.append(f"    bandwidth: {achieved / 1e9:.2f} GB/s over engine.step() = "
                 f"{100 * achieved / physical:.0f} % of the raw {physical / 1e9:.2f} GB/s (write "
                 f"{raw['write'] / 1e9:.2f}, read {raw['read'] / 1e9:.2f} GB/s, both ranks at "
                 f"once); inside the I/O calls {in_calls / 1e9:.2f} GB/s")
    lines.append(f"    step times {times} s, engine.step() "
                 + ", ".join(f"{t:.1f}" for t in step_s)
                 + f" s; {report['tokens_per_step'] / seconds:.1f} tokens/s; MFU "
                 f"{100 * flops / seconds / x['peak_flops']:.2f} % of the "
                 f"{x['peak_flops'] / 1e12:.2f} TFLOP/s a bf16 matmul reached on this rank")
    return lines


def main(argv: list[str] | None = None) -> int:
    prog = "python -m minizero.scale --infinity"
    ap = OneLineParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=N_LAYER,
                    help=f"blocks of width {N_EMBD} (default {N_LAYER})")
    ap.add_argument("--cap-gb", type=float, default=CAP_GB,
                    help=f"private memory per rank (default {CAP_GB:g})")
    ap.add_argument("--world-size", type=int, default=2, help="ranks N (default 2)")
    ap.add_argument("--offload-path", default=None, metavar="DIR",
                    help="folder of the disk tier's files (default: the temp folder)")
    add_json_flag(ap, "the report")
    try:
        args = ap.parse_args(argv)
        if args.layers < 1 or args.world_size < 2 or not args.cap_gb > 0:
            raise UsageError("--layers must be >= 1, --world-size >= 2 and --cap-gb > 0")
        folder = args.offload_path or tempfile.gettempdir()
        try:
            check_folder(folder)
        except ValueError as e:
            raise UsageError(str(e)) from None
        need = K * count_params(model_config(args.layers)) * 1.05     # every rank's file, and room
        free = shutil.disk_usage(folder).free
        if free < need:
            raise UsageError(f"{folder} has {free / 1e9:.1f} GB free; the optimizer state needs "
                             f"{need / 1e9:.1f} GB")
    except UsageError as e:
        return fail(prog, str(e))
    start = time.perf_counter()
    report = run(args.layers, args.cap_gb, args.world_size, folder)
    report["wall_seconds"] = time.perf_counter() - start
    emit(format_report(report) + f"\nwall time {report['wall_seconds']:.0f} s", report, args.json)
    return 0 if report["rows"][-1]["trained"] else 1


if __name__ == "__main__":
    sys.exit(main())
