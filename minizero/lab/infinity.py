"""ZeRO-Infinity's disk tier at full size: a 1.5B-parameter GPT trains on a machine that cannot hold it.

    python -m minizero.scale --infinity                        # GPT-2 XL's shape, N = 2 (see the timing below)
    python -m minizero.scale --infinity --layers 4 --cap-gb 2  # ~120M parameters: the same story in ~2 min

GPT-2 XL's shape (48 blocks of width 1600; the lab's 12-token vocabulary): Ψ ≈ 1.48 × 10^9. Trained in
bf16 with AdamW, its model states are 16Ψ ≈ 24 GB: all of this machine's memory, before activations,
the interpreter or anything else running. Each variant runs N = 2 ranks, built with
minizero.sharded_init (stage 3) or the usual way (DDP), activation checkpointing on, under a cap of
--cap-gb of private memory per rank (RLIMIT_DATA, minizero.launch(memory_cap=...), as lab/rss.py):

    DDP              16Ψ a rank       stops at construction with the launcher's one-line out-of-memory
    stage 3          16Ψ/N a rank     stops when AdamW creates its state (the fp32 master first)
    stage 3 + disk   4Ψ/N a rank      the 12Ψ/N of optimizer state in a file (disk.py): trains

The cap stands for the machine's memory: the kernel refuses the allocation that crosses it, so the
runs that cannot fit fail in their own rank, in one line, and never wake the kernel's OOM killer for
the other jobs on the machine. For the disk run the command prints, per rank: the peak resident set
(VmHWM) next to 4Ψ/N; the bytes the file holds, reads and writes per step next to KΨ/N
(memory.estimate_breakdown, memory.disk_traffic); the bandwidth the overlapped pipeline achieved
(bytes moved / seconds of engine.step()) next to a raw sequential write and read of the same bytes by
the same file code in the same run, both ranks at once (the physical limit); step time, tokens/s and
the model-FLOPs utilisation against a bf16 matmul timed on each rank's core.

Measured here (2 shared cores, N = 2, --cap-gb 6): see the README's "ZeRO-Infinity" section.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
import time

import torch

from minizero import comm
from minizero.cli import OneLineParser, UsageError, emit, fail
from minizero.disk import ALIGN, IO_CHUNK, ScratchFile, aligned_buffer, check_folder
from minizero.lab.data import sequence_length
from minizero.lab.model import GPTConfig, count_params
from minizero.lab.rss import _fixed_mmap_threshold, proc_status
from minizero.lab.train import TrainConfig, train_worker
from minizero.launcher import launch
from minizero.memory import disk_traffic, estimate_breakdown
from minizero.wrap import wrap

N_LAYER, N_EMBD, N_HEAD = 48, 1600, 25     # GPT-2 XL
BLOCK_SIZE = 64                            # tokens a row
ROWS = 2                                   # rows a rank computes per step
STEPS = 3
CAP_GB = 6.5                               # private memory a rank may hold (both ranks: 13 of the 24 GB)
VARIANTS = (("DDP", 0, False), ("stage 3", 3, False), ("stage 3 + disk", 3, "disk"))
LR = 2e-5
# torch's fused CPU AdamW: ~4x the single-tensor path here, as DeepSpeed's CPU Adam is to torch's
OPTIMIZER_PARAMS = {"fused": True}
K = 12                                     # bf16 AdamW: fp32 master + two moments


def model_config(layers: int = N_LAYER) -> GPTConfig:
    return GPTConfig(n_layer=layers, n_embd=N_EMBD, n_head=N_HEAD, block_size=BLOCK_SIZE)


def train_config(stage: int, offload, layers: int, world_size: int, folder: str) -> TrainConfig:
    return TrainConfig(stage=stage, offload=offload, offload_path=folder if offload else None,
                       world_size=world_size, steps=STEPS, batch_size=ROWS * world_size, dtype="bf16",
                       lr=LR, optimizer_params=OPTIMIZER_PARAMS, model_overrides=dataclasses.asdict(model_config(layers)),
                       sharded_init=stage == 3, activation_checkpointing=True)


def raw_bandwidth(folder: str, nbytes: int) -> dict:
    """Collective: every rank writes then reads `nbytes` sequentially through a ScratchFile (the disk
    tier's own calls, one IO_CHUNK buffer), all ranks at once as in training. Bytes/s of each."""
    nbytes = -(-nbytes // ALIGN) * ALIGN
    file = ScratchFile(folder, nbytes)
    buffer = aligned_buffer(min(IO_CHUNK, nbytes))
    buffer.random_(0, 256)
    out = {}
    try:
        for what, call in (("write", file.write), ("read", file.read)):
            comm.barrier()
            start = time.perf_counter()
            for offset in range(0, nbytes, buffer.numel()):
                call(buffer[: min(buffer.numel(), nbytes - offset)], offset)
            out[what] = nbytes / (time.perf_counter() - start)
    finally:
        file.close()
    return out


def matmul_flops(size: int = 2048, repeats: int = 8) -> float:
    """FLOP/s of a bf16 matmul on this rank's threads: the peak its MFU is measured against."""
    a = torch.randn(size, size, dtype=torch.bfloat16)
    a @ a
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    return 2 * size ** 3 * repeats / (time.perf_counter() - start)


def capped_worker(cfg: TrainConfig) -> dict:
    """Worker: train cfg (the disk run first times the raw disk and a matmul), then this rank's figures."""
    _fixed_mmap_threshold()
    out = {"rank": comm.rank()}
    built = {}

    def make_engine(*args, **kwargs):                 # train_worker's engine, kept to read its file's counters
        built["engine"] = wrap(*args, **kwargs)
        if cfg.offload == "disk":                     # from here on: what the steps read and write
            built["at_start"] = _counters(built["engine"].optimizer.file)
        return built["engine"]

    if cfg.offload == "disk":
        psi = count_params(cfg.model_config())
        out["raw"] = raw_bandwidth(cfg.offload_path, int(K * psi / cfg.world_size))
        out["peak_flops"] = matmul_flops()
    result = train_worker(cfg, make_engine)
    out.update({key: result[key] for key in ("losses", "step_times", "phase_times", "memory",
                                             "num_params")})
    out["status"] = proc_status()
    if cfg.offload == "disk":
        optimizer = built["engine"].optimizer
        now = _counters(optimizer.file)
        out["disk"] = {"file": optimizer.file.allocated(), "pieces": len(optimizer.pieces),
                       **{key: now[key] - built["at_start"][key] for key in now}}
    return out


def _counters(file: ScratchFile) -> dict:
    return {"read": file.read_bytes, "written": file.written_bytes, "read_seconds": file.read_seconds,
            "write_seconds": file.write_seconds}


def run(layers: int = N_LAYER, cap_gb: float = CAP_GB, world_size: int = 2, folder: str | None = None) -> dict:
    """Every variant under the cap; {"rows": [...], ...} for format_report."""
    folder = folder or tempfile.gettempdir()
    mcfg = model_config(layers)
    psi = count_params(mcfg)
    cap = int(cap_gb * 1e9)
    rows = []
    for label, stage, offload in VARIANTS:
        formula = estimate_breakdown(psi, world_size, stage, k=K, offload=offload)
        row = {"variant": label, "stage": stage, "offload": offload, "formula": formula}
        start = time.perf_counter()
        try:
            ranks = launch(capped_worker, world_size, train_config(stage, offload, layers, world_size, folder),
                           backend="gloo", memory_cap=cap)
            row.update(trained=True, ranks=ranks)
        except RuntimeError as e:
            row.update(trained=False, error=str(e).splitlines()[0])
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
    tokens = ROWS * world_size * sequence_length(BLOCK_SIZE)
    return {"mode": "infinity", "num_params": psi, "n_layer": layers, "n_embd": N_EMBD, "world_size": world_size,
            "cap_bytes": cap, "folder": folder, "tokens_per_step": tokens, "steps": STEPS, "rows": rows}


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def format_report(report: dict) -> str:
    psi, n, cap = report["num_params"], report["world_size"], report["cap_bytes"]
    lines = [f"GPT n_layer {report['n_layer']}, n_embd {report['n_embd']}: Ψ = {psi / 1e9:.3f} B, bf16 AdamW, "
             f"activation checkpointing, N = {n}; 16Ψ = {_gb(16 * psi)} of model states",
             f"each rank capped at {_gb(cap)} of private memory (RLIMIT_DATA): {_gb(n * cap)} for the run"]
    for r in report["rows"]:
        f = r["formula"]
        ram = f["params"] + f["grads"] + f["optimizer"] + f["offloaded"]
        head = f"{r['variant']:15} needs {_gb(ram)} a rank in memory" + (f" + {_gb(f['disk'])} on disk"
                                                                         if f["disk"] else "")
        if not r["trained"]:
            lines.append(f"{head}: {r['error']} ({r['seconds']:.0f} s)")
            continue
        ranks = r["ranks"]
        losses = [sum(s) / n for s in zip(*(x["losses"] for x in ranks))]
        lines.append(f"{head}: trained {report['steps']} steps in {r['seconds']:.0f} s, loss "
                     + " -> ".join(f"{x:.4f}" for x in losses))
        traffic = disk_traffic(psi, n, k=K)
        for x in ranks:
            steps = len(x["step_times"])
            step_s = [p["step"] for p in x["phase_times"]]
            lines.append(f"  rank {x['rank']}: peak RSS {_gb(x['status']['VmHWM'])}, private "
                         f"{_gb(x['status']['VmData'])} (formula 4Ψ/N "
                         f"{_gb(ram)}); engine params {_gb(x['memory']['params'])}, grads "
                         f"{_gb(x['memory']['grads'])}, optimizer in memory {_gb(x['memory']['optimizer'])}")
            if "disk" in x:
                d = x["disk"]
                moved = d["read"] + d["written"]
                achieved = moved / sum(step_s)
                raw = 2 / (1 / x["raw"]["read"] + 1 / x["raw"]["write"])      # same bytes each way
                lines.append(f"    disk: file {_gb(d['file'])} (KΨ/N {_gb(f['disk'])}, {d['pieces']} pieces); "
                             f"per step read {_gb(d['read'] / steps)}, written {_gb(d['written'] / steps)} "
                             f"(formula {_gb(traffic['read'])} each)")
                in_calls = moved / (d["read_seconds"] + d["write_seconds"])
                lines.append(f"    bandwidth: {achieved / 1e9:.2f} GB/s over engine.step() = "
                             f"{100 * achieved / raw:.0f} % of raw {raw / 1e9:.2f} GB/s (write "
                             f"{x['raw']['write'] / 1e9:.2f}, read {x['raw']['read'] / 1e9:.2f} GB/s, "
                             f"both ranks at once); inside the I/O thread's calls {in_calls / 1e9:.2f} GB/s "
                             f"= {100 * in_calls / raw:.0f} %")
                total = [sum(p.values()) for p in x["phase_times"]]
                flops = 6 * psi * report["tokens_per_step"] / n                 # this rank's tokens
                lines.append(f"    step times " + ", ".join(f"{t:.1f}" for t in x["step_times"])
                             + f" s (of which engine.step() " + ", ".join(f"{t:.1f}" for t in step_s)
                             + f" s); {report['tokens_per_step'] / (sum(total) / steps):.1f} tokens/s; "
                             f"MFU {100 * flops / (sum(total) / steps) / x['peak_flops']:.2f} % of "
                             f"{x['peak_flops'] / 1e12:.2f} TFLOP/s")
    lines.append("formula: memory.estimate_breakdown (bf16 params and grads 2 + 2 bytes, K = 12); RSS includes "
                 "the interpreter and torch (~0.4 GB), activations and gathered units")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    prog = "python -m minizero.scale --infinity"
    ap = OneLineParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=N_LAYER, help=f"blocks of width {N_EMBD} (default {N_LAYER})")
    ap.add_argument("--cap-gb", type=float, default=CAP_GB, help=f"private memory per rank (default {CAP_GB:g})")
    ap.add_argument("--world-size", type=int, default=2, help="ranks N (default 2)")
    ap.add_argument("--offload-path", default=None, help="folder of the disk tier's files (default: the temp dir)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    try:
        args = ap.parse_args(argv)
        if args.layers < 1 or args.world_size < 2 or not args.cap_gb > 0:
            raise UsageError("--layers >= 1, --world-size >= 2 and --cap-gb > 0 are needed")
        folder = args.offload_path or tempfile.gettempdir()
        try:
            check_folder(folder)
        except ValueError as e:
            raise UsageError(str(e)) from None
        need = K * count_params(model_config(args.layers)) * 1.05       # every rank's file, with room
        free = shutil.disk_usage(folder).free
        if free < need:
            raise UsageError(f"{folder} has {free / 1e9:.1f} GB free; the optimizer state needs {need / 1e9:.1f} GB")
    except UsageError as e:
        return fail(prog, str(e))
    start = time.perf_counter()
    report = run(args.layers, args.cap_gb, args.world_size, folder)
    report["wall_seconds"] = time.perf_counter() - start
    emit(format_report(report) + f"\nwall time {report['wall_seconds']:.0f} s", report, args.json)
    return 0 if report["rows"][-1]["trained"] else 1


if __name__ == "__main__":
    sys.exit(main())
