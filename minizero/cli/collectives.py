"""Each collective as the backend runs it and as minizero.comm runs it, timed.

    python -m minizero.collectives      (= python -m minizero collectives; --help for the options)

The command's arguments and output are here; the experiment itself is minizero/lab/collectives.py.
"""

from __future__ import annotations

from minizero.cli import OneLineParser, UsageError, add_json_flag, emit, fail
from minizero.lab.collectives import format_table, measure


def main(argv: list[str]) -> int:
    prog = "python -m minizero.bench --collectives"
    ap = OneLineParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument(
        "--world-size", type=int, nargs="+", default=[2, 4], help="one or more N (default 2 4)"
    )
    ap.add_argument("--numel", type=float, nargs="+", default=[1e6, 8e6, 50e6],
                    help="fp32 elements per collective (default 1e6 8e6 50e6)")
    ap.add_argument("--repeats", type=int, default=4, help="calls per collective (default 4)")
    add_json_flag(ap, "the report")
    try:
        args = ap.parse_args(argv)
        if any(n < 2 for n in args.world_size) or args.repeats < 1:
            raise UsageError("--world-size: every N must be >= 2, and --repeats >= 1")
        if any(not 1 <= x <= 1e9 for x in args.numel):
            raise UsageError(f"--numel must be between 1 and 1e9 elements, got {args.numel}")
    except UsageError as e:
        return fail(prog, str(e))
    numels = [max(int(x), max(args.world_size)) for x in args.numel]
    report = measure(tuple(args.world_size), numels, args.repeats)
    emit(format_table(report), report, args.json)
    return 0
