"""Muon under ZeRO, measured: its step time against AdamW's and DeepSpeed's Muon, and what each
design costs a rank.

    python -m minizero.bench --muon                   (= python -m minizero bench --muon)
    python -m minizero.bench --muon --sizes 1M,8M --stages 1,2,3 --world-size 2
    python -m minizero.bench --muon --costs           # bytes, momentum, Newton-Schulz: N = 2, 3, 4

The command's arguments and output are here; the experiments are minizero/lab/bench.py
(compare_muon) and minizero/lab/muon_costs.py (costs).
"""

from __future__ import annotations

from minizero.cli import OneLineParser, UsageError, add_json_flag, emit, fail
from minizero.lab.bench import compare_muon, format_muon_table
from minizero.lab.model import SIZES
from minizero.lab.muon_costs import costs, format_costs


def main(argv: list[str] | None = None) -> int:
    prog = "python -m minizero.bench --muon"
    p = OneLineParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--costs", action="store_true",
                   help="each design's bytes, momentum and Newton-Schulz per rank, next to its "
                        "formula, instead of step times")
    p.add_argument("--sizes", default=None, metavar="S,S,...",
                   help=f"model sizes from {','.join(SIZES)} (default 1M,8M; --costs: 1M)")
    p.add_argument("--stages", default="1,2,3", help="ZeRO stages (default 1,2,3; step times)")
    p.add_argument("--world-size", type=int, nargs="+", default=None,
                   help="N (default 2; --costs: 2 3 4)")
    p.add_argument("--steps", type=int, default=6, help="steps per run (default 6)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each side (default 2)")
    add_json_flag(p, "the measurements")
    try:
        args = p.parse_args(argv)
        sizes = (args.sizes or ("1M" if args.costs else "1M,8M")).split(",")
        stages = tuple(int(s) for s in args.stages.split(","))
        if any(s not in SIZES for s in sizes):
            raise UsageError(f"--sizes must be among {','.join(SIZES)}, got {args.sizes}")
        if any(s not in (1, 2, 3) for s in stages):
            raise UsageError(f"--stages must be among 1,2,3, got {args.stages}")
        if any(n < 1 for n in args.world_size or ()) or args.steps < 2 or args.repeats < 1:
            raise UsageError("--world-size >= 1, --steps >= 2 and --repeats >= 1")
    except (UsageError, ValueError) as e:
        return fail(prog, str(e))
    if args.costs:
        records = costs(tuple(args.world_size or (2, 3, 4)), sizes[0], args.steps)
        emit(format_costs(records, sizes[0]), {"records": records}, args.json)
        return 0
    report = compare_muon(args.world_size[0] if args.world_size else 2, sizes, stages, args.steps,
                          args.repeats)
    emit(format_muon_table(report), report, args.json)
    return 0
