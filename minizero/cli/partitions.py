"""Flat partition by element against whole parameters per rank: optimizer state, balance, padding
and bytes, measured.

    python -m minizero.bench --partitions     (= python -m minizero bench --partitions; --help)

The command's arguments and output are here; the experiment itself is minizero/lab/partitions.py.
"""

from __future__ import annotations

import sys

from minizero.cli import OneLineParser, UsageError, add_json_flag, emit, fail
from minizero.lab.model import MODEL_NAMES, SIZES


def main(argv: list[str] | None = None) -> int:
    from minizero.lab.partitions import format_table, measure_partitions
    prog = "python -m minizero.bench --partitions"
    ap = OneLineParser(prog=prog, description="stage 1's flat partition against torch's whole "
                                              "parameters per rank, on one model")
    ap.add_argument("--world-size", type=int, nargs="+", default=[2, 3, 4],
                    help="one or more N (default 2 3 4)")
    ap.add_argument("--model", default="default",
                    help=f"{', '.join(MODEL_NAMES + tuple(SIZES))} (default: default)")
    add_json_flag(ap, "the figures")
    try:
        args = ap.parse_args(sys.argv[1:] if argv is None else argv)
        if any(n < 2 for n in args.world_size) or any(12 % n for n in args.world_size):
            raise UsageError("--world-size: every N must be >= 2 and split the 12 rows evenly "
                             "(2, 3, 4, 6 or 12)")
        if args.model not in MODEL_NAMES + tuple(SIZES):
            raise UsageError(f"--model must be one of {', '.join(MODEL_NAMES + tuple(SIZES))}")
    except UsageError as e:
        return fail(prog, str(e))
    report = measure_partitions(tuple(args.world_size), args.model)
    emit(format_table(report), report, args.json)
    return 0
