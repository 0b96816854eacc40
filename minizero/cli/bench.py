"""minizero against PyTorch's and DeepSpeed's implementation of every stage.

    python -m minizero.bench      (= python -m minizero bench; --help for the options)

The command's arguments and output are here; the experiment itself is minizero/lab/bench.py.
"""

from __future__ import annotations

import sys

import torch

from minizero.cli import OneLineParser, UsageError, add_json_flag, emit, fail, mode_of
from minizero.cli import collectives, desync_cost, muon, partitions, peak, scale   # the others
from minizero.lab import deepspeed_peer
from minizero.lab.bench import (
    ALL_VARIANTS, BACKENDS, PEER_DTYPE, PEER_FAMILIES, VARIANTS, compare, format_table,
)
from minizero.lab.model import MODEL_NAMES, SIZES
from minizero.lab.train import progress_wanted

SPLITS = (1, 2, 4, 8, 16)           # the N that split the batch of 16 rows evenly


def main(argv: list[str] | None = None) -> int:
    prog = "python -m minizero.bench"
    # --scale, --peak, --collectives, --desync, --muon and --partitions run another measurement,
    # with options of its own
    try:
        mode, argv = mode_of(
            sys.argv[1:] if argv is None else argv,
            {"--scale": scale.main, "--peak": peak.main, "--collectives": collectives.main,
             "--desync": desync_cost.main, "--muon": muon.main, "--partitions": partitions.main},
        )
    except UsageError as e:
        return fail(prog, str(e))
    if mode is not None:
        return mode(argv)
    ap = OneLineParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument(
        "--world-size", type=int, nargs="+", default=None,
        help="one or more N (default 2 4; with --device cuda all the GPUs, up to 16: one per rank)",
    )
    ap.add_argument("--device", choices=list(BACKENDS), default="cpu",
                    help="cpu (default: gloo, one process per rank) or cuda (NCCL, one GPU per "
                         "rank)")
    ap.add_argument("--dtype", choices=[PEER_DTYPE, "bf16"], default=PEER_DTYPE,
                    help=f"{PEER_DTYPE} (default: every pair) or bf16 (minizero alone: the peers "
                         f"run in {PEER_DTYPE} only); MFU is against the GEMM peak at this dtype")
    ap.add_argument(
        "--steps", type=int, default=10, help="steps per run (default 10, the first is warm-up)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side per pair (default 3)")
    ap.add_argument(
        "--model",
        default="default",
        help=f"{' or '.join(MODEL_NAMES)}: the one size without --sizes",
    )
    ap.add_argument(
        "--sizes",
        default=None,
        metavar="S,S,...",
        help=(
            f"model sizes, comma-separated, from {','.join(SIZES)} (and {','.join(MODEL_NAMES)}); "
            "skips the activation meter's timing"
        ),
    )
    ap.add_argument(
        "--stages",
        nargs="+",
        default=list(VARIANTS),
        help=f"among {' '.join(ALL_VARIANTS)} (default {' '.join(VARIANTS)}; 3+tp2: stage 3 on a "
             "mesh of tensor-parallel rows of 2, next to PyTorch's TP + FSDP2; fully_shard, ddp, "
             "ddp+zero: minizero's PyTorch front ends next to torch's own, in torch's loop)",
    )
    ap.add_argument(
        "--peers",
        default=",".join(PEER_FAMILIES),
        help="torch and/or deepspeed, comma-separated (default both; deepspeed when installed)",
    )
    ap.add_argument(
        "--phases",
        action="store_true",
        help="also print each pair's profile: forward, backward and step times (always in --json)",
    )
    add_json_flag(ap, "the report")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress bar (also off when stderr is no terminal)")
    ap.add_argument(
        "--scale",
        action="store_true",
        help=(
            "run the scale demo instead (see minizero.scale; "
            "takes --budget-mb, --world-size, --micro-batch, --model, --json)"
        ),
    )
    ap.add_argument("--peak", action="store_true",
                    help="measure the machine's GEMM peak instead (takes --world-size, --dtypes, "
                         "--device, --threads, --json; minizero/lab/throughput.py)")
    ap.add_argument(
        "--collectives",
        action="store_true",
        help=(
            "time each collective as the backend and as "
            "minizero.comm run it instead (takes --world-size, --numel, --repeats, --json)"
        ),
    )
    ap.add_argument("--partitions", action="store_true",
                    help="stage 1's flat partition against torch's whole parameters per rank "
                         "instead (takes --world-size, --model, --json; lab/partitions.py)")
    ap.add_argument("--desync", action="store_true",
                    help="what the desync watch costs a step instead (takes --size, --stages, "
                         "--world-size, --steps, --repeats; minizero/lab/desync_cost.py)")
    ap.add_argument("--muon", action="store_true",
                    help="Muon's step against AdamW's and DeepSpeed's Muon instead, or with "
                         "--costs what each Muon design costs a rank (takes --sizes, --stages, "
                         "--world-size, --steps, --repeats, --json; minizero/lab/muon_costs.py)")
    try:
        args = ap.parse_args(argv)
        world_sizes, sizes, peers = _validate(args)
    except UsageError as e:
        return fail(prog, str(e))
    try:
        report = compare(
            world_sizes,
            sizes=sizes,
            steps=args.steps,
            repeats=args.repeats,
            variants=tuple(args.stages),
            peers=peers,
            meter=args.sizes is None,
            device=args.device,
            dtype=args.dtype,
            progress=progress_wanted(args.quiet, args.json),
        )
    except RuntimeError as e:                       # a rank failed: the launcher says which and why
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    emit(format_table(report, args.phases), report, args.json)
    return 0


def _validate(args) -> tuple[tuple[int, ...], tuple[str, ...], tuple[str, ...]]:
    """(world sizes, sizes, peer families) from the flags, or UsageError."""
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device cuda: no GPU here (torch {torch.__version__}: "
                             "torch.cuda.is_available() is False)")
        gpus = torch.cuda.device_count()
        # default: one N, the most GPUs that split the batch (1 with one GPU: NCCL cannot put two
        # ranks on one GPU)
        world_sizes = tuple(args.world_size or [max(n for n in SPLITS if n <= gpus)])
        if any(not 1 <= n <= gpus for n in world_sizes):
            raise UsageError(f"--world-size: every N must be between 1 and the {gpus} GPU(s) here "
                             "(NCCL: one GPU per rank)")
    else:
        world_sizes = tuple(args.world_size or [2, 4])
        if any(n < 2 for n in world_sizes):
            raise UsageError("--world-size: every N must be >= 2 on cpu (N = 1 shards nothing; "
                             "it is for --device cuda on one GPU)")
    if args.steps < 2 or args.repeats < 1:
        raise UsageError("--steps must be >= 2 (the first is warm-up) and --repeats >= 1")
    if args.model not in MODEL_NAMES:
        raise UsageError(f"--model must be one of {', '.join(MODEL_NAMES)}, got {args.model!r}")
    sizes = tuple(args.sizes.split(",")) if args.sizes is not None else (args.model,)
    known = tuple(SIZES) + MODEL_NAMES
    if not sizes or not set(sizes) <= set(known):
        raise UsageError(f"--sizes must be among {','.join(known)}, got {args.sizes!r}")
    if not set(args.stages) <= set(ALL_VARIANTS):
        raise UsageError(
            f"--stages must be among {' '.join(ALL_VARIANTS)}, got {' '.join(args.stages)}"
        )
    peers = tuple(args.peers.split(","))
    if not peers or not set(peers) <= set(PEER_FAMILIES):
        raise UsageError(f"--peers must be among {','.join(PEER_FAMILIES)}, got {args.peers!r}")
    if peers == ("deepspeed",) and not deepspeed_peer.available():
        raise UsageError(
            "--peers deepspeed: DeepSpeed is not installed "
            "(DS_BUILD_OPS=0 pip install -e '.[peers]')"
        )
    if any(16 % n for n in world_sizes):
        raise UsageError("--world-size: the batch of 16 rows must split evenly "
                         f"(N in {', '.join(map(str, SPLITS))})")
    return world_sizes, sizes, peers

