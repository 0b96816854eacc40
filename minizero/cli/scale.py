"""The largest model (or micro-batch) each stage trains within a memory budget, measured.

    python -m minizero.scale      (= python -m minizero scale; --help for the options)

The command's arguments and output are here; the experiment itself is minizero/lab/scale.py.
"""

from __future__ import annotations

import sys

from minizero.cli import OneLineParser, UsageError, add_json_flag, emit, fail, mode_of
from minizero.lab import infinity
from minizero.lab.model import MODEL_NAMES
from minizero.lab.scale import format_table, largest_micro_batches, largest_models
from minizero.lab.train import progress_wanted


def main(argv: list[str] | None = None) -> int:
    prog = "python -m minizero.scale"
    # --infinity: the 1.5B-parameter demonstration, with options of its own (lab/infinity.py)
    try:
        mode, argv = mode_of(sys.argv[1:] if argv is None else argv, {"--infinity": infinity.main})
    except UsageError as e:
        return fail(prog, str(e))
    if mode is not None:
        return mode(argv)
    ap = OneLineParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--budget-mb", type=float, default=None,
                    help="per-rank device budget in MB (default 4; 8 with --micro-batch)")
    ap.add_argument(
        "--world-size", type=int, nargs="+", default=None, help="N values (default 1 2 4; --rss: 4)"
    )
    ap.add_argument(
        "--micro-batch",
        action="store_true",
        help=(
            "fixed model (--model): the largest micro-batch "
            "per stage, without and with checkpointing"
        ),
    )
    ap.add_argument(
        "--model",
        default=None,
        help=f"with --micro-batch: {' or '.join(MODEL_NAMES)} (default default)",
    )
    ap.add_argument(
        "--rss",
        action="store_true",
        help=(
            "a GPT whose DDP model states exceed a per-rank "
            "memory cap: DDP runs out, stage 3 trains "
            "(measured RSS; lab/rss.py)"
        ),
    )
    ap.add_argument(
        "--rss-cap-mb",
        type=float,
        default=None,
        help=(
            "with --rss: each rank's cap in MB beyond the baseline, "
            "what a rank holds whatever the model (default 200)"
        ),
    )
    add_json_flag(ap, "the report")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress bar (also off when stderr is no terminal)")
    try:
        args = ap.parse_args(argv)
        if args.rss:
            _check_rss(args)
        elif args.rss_cap_mb is not None:
            raise UsageError("--rss-cap-mb needs --rss")
        args.world_size = args.world_size or ([4] if args.rss else [1, 2, 4])
        if args.budget_mb is None:
            args.budget_mb = 8.0 if args.micro_batch else 4.0
        if not args.budget_mb > 0:
            raise UsageError(f"--budget-mb must be > 0, got {args.budget_mb}")
        if args.budget_mb > 1000:
            raise UsageError(
                "--budget-mb above 1000 would train models too big for a quick CPU demo"
            )
        if any(n < 1 for n in args.world_size):
            raise UsageError("--world-size: every N must be >= 1")
        if args.model is not None and not args.micro_batch:
            raise UsageError("--model needs --micro-batch (the width search grows its own GPT)")
        if args.micro_batch and (args.model or "default") not in MODEL_NAMES:
            raise UsageError(f"--model must be one of {', '.join(MODEL_NAMES)}, got {args.model!r}")
    except UsageError as e:
        return fail(prog, str(e))
    if args.rss:
        return _rss(prog, args)
    try:
        if args.micro_batch:
            report = largest_micro_batches(args.budget_mb, tuple(args.world_size),
                                           args.model or "default",
                                           progress=progress_wanted(args.quiet, args.json))
        else:
            report = largest_models(args.budget_mb, tuple(args.world_size),
                                    progress=progress_wanted(args.quiet, args.json))
    except RuntimeError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    emit(format_table(report), report, args.json)
    return 0


def _check_rss(args) -> None:
    if args.micro_batch or args.budget_mb is not None or args.model is not None:
        raise UsageError("--rss takes only --rss-cap-mb, --world-size and --json")
    if args.world_size is not None and (len(args.world_size) != 1 or args.world_size[0] < 2):
        raise UsageError(
            f"--rss takes one --world-size N >= 2, got {' '.join(map(str, args.world_size))}"
        )
    if args.rss_cap_mb is not None and not 0 < args.rss_cap_mb <= 2000:
        raise UsageError(
            f"--rss-cap-mb must be in (0, 2000] (a quick CPU demo), got {args.rss_cap_mb:g}"
        )


def _rss(prog: str, args) -> int:
    """--rss: lab/rss.py's capped runs (it imports this module: hence imported here)."""
    from minizero.lab import rss
    try:
        report = rss.capped_runs(args.rss_cap_mb or rss.CAP_MB, args.world_size[0])
    except RuntimeError as e:                 # the baseline launch failed: nothing to show
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    emit(rss.format_rss_table(report), report, args.json)
    return 0
