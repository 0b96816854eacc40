"""The machine's GEMM peak, which MFU divides by.

    python -m minizero.bench --peak      (= python -m minizero bench --peak; --help for the options)

The command's arguments and output are here; the experiment itself is minizero/lab/throughput.py.
"""

from __future__ import annotations

import sys

import torch

from minizero.cli import OneLineParser, UsageError, add_json_flag, emit, fail
from minizero.lab.throughput import gemm_size, peaks_worker
from minizero.optim import DTYPES


def main(argv: list[str] | None = None) -> int:
    """python -m minizero.bench --peak: the machine's matmul peak, per rank and in all, per
    dtype."""
    from minizero.launcher import launch
    prog = "python -m minizero.bench --peak"
    ap = OneLineParser(prog=prog, description="the GEMM peak MFU divides by, every rank at once")
    ap.add_argument("--world-size", type=int, default=1,
                    help="ranks multiplying at once (default 1)")
    ap.add_argument("--dtypes", default="fp32,bf16",
                    help="comma-separated, among " + ",".join(DTYPES))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cpu (gloo) or cuda (nccl)")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads per rank (default 1, as the bench's; 0: torch's)")
    add_json_flag(ap, "the peaks")
    try:
        args = ap.parse_args(sys.argv[1:] if argv is None else argv)
        dtypes = args.dtypes.split(",")
        if not set(dtypes) <= set(DTYPES) or args.world_size < 1 or args.threads < 0:
            raise UsageError(f"--dtypes must be among {','.join(DTYPES)}, --world-size >= 1, "
                             "--threads >= 0")
        if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
            raise UsageError("--device cuda needs one GPU per rank: "
                             f"{torch.cuda.device_count()} GPUs")
    except UsageError as e:
        return fail(prog, str(e))
    backend = "nccl" if args.device == "cuda" else "gloo"
    per_rank = launch(peaks_worker, args.world_size, dtypes, args.threads or None, backend=backend)
    report = {"world_size": args.world_size, "device": args.device,
              "threads_per_rank": args.threads or None,
              "peak_flops_per_s": {d: sum(r[d] for r in per_rank) for d in dtypes},
              "per_rank": per_rank}
    size = gemm_size(torch.device(args.device))
    lines = [(f"GEMM peak ([{size}x{size}] products), {args.world_size} rank(s) at "
              f"once on {args.device}:")]
    for d in dtypes:
        low, high = (f(r[d] for r in per_rank) / 1e9 for f in (min, max))
        lines.append(f"  {d}: {report['peak_flops_per_s'][d] / 1e9:,.1f} GFLOP/s in all, "
                     f"{low:,.1f} to {high:,.1f} per rank")
    emit("\n".join(lines), report, args.json)
    return 0
