"""What the desync watch (fingerprints, flight recorder, watchdog) costs a training step.

    python -m minizero.bench --desync      (= python -m minizero bench --desync; --help for options)

The command's arguments and output are here; the experiment itself is minizero/lab/desync_cost.py.
"""

from __future__ import annotations

import statistics

from minizero.cli import OneLineParser, UsageError, fail
from minizero.lab.desync_cost import SETTINGS, cost_worker
from minizero.lab.train import TrainConfig
from minizero.launcher import launch


def main(argv: list[str] | None = None) -> int:
    prog = "python -m minizero.bench --desync"
    p = OneLineParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--size", default="8M")
    p.add_argument("--stages", default="2,3")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    try:
        args = p.parse_args(argv)
    except UsageError as e:
        return fail(prog, str(e))
    cfgs = [TrainConfig(stage=int(s), world_size=args.world_size, steps=args.steps,
                        model=args.size) for s in args.stages.split(",")]
    ranks = launch(cost_worker, args.world_size, cfgs, args.repeats, stall_timeout=None,
                   check_every=0)
    slowest = {key: [max(v) for v in zip(*(r[key] for r in ranks))]
               for key in ranks[0] if key != "collectives"}
    median = {key: statistics.median(v) for key, v in slowest.items()}
    for cfg in cfgs:
        count, off = ranks[0]["collectives"][cfg.stage], median[f"stage {cfg.stage}, off"]
        print(f"{args.size} stage {cfg.stage} N={args.world_size}: {count} collectives and "
              f"{off * 1e3:.0f} ms per step (watch off)")
        for name in list(SETTINGS)[1:]:
            added = median[f"call, {name}"] - median["call, off"]
            whole = median[f"stage {cfg.stage}, {name}"] / off - 1
            print(f"  watch {name:>9}: {added * 1e6:+6.1f} us CPU per collective = "
                  f"{added * count / off * 100:+.2f} % of a step; whole steps {whole * 100:+.1f} %")
    return 0
