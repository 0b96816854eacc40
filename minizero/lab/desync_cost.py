"""What minizero.desync costs a training step: the same steps with its watch on and off, interleaved.

    python -m minizero.lab.desync_cost                         # 8M, stages 2 and 3, N = 2
    python -m minizero.lab.desync_cost --size 8M --stages 3 --world-size 2 --steps 8 --repeats 3

One launch with the launcher's watch off; inside it each rank turns a watch on (desync.watch) and off
between runs, so that both sides share the process group, the warm caches and the machine's load.
Prints each stage's median step time (the slowest rank's, steps after the first of each run) with the
watch off, with it on at the default check_every, and on with a check before every collective (the
most it can cost), and the difference in percent.
"""

from __future__ import annotations

import argparse
import statistics

from minizero import desync
from minizero.launcher import launch
from minizero.lab.train import TrainConfig, train_worker

SETTINGS = {"off": None, f"every {desync.DEFAULT_CHECK_EVERY}": desync.DEFAULT_CHECK_EVERY,
            "every 1": 1}


def cost_worker(cfgs: list[TrainConfig], repeats: int) -> dict:
    """Per (stage, setting): this rank's step times (the first step of each run left out)."""
    times: dict = {}
    for _ in range(repeats):
        for cfg in cfgs:
            for name, every in SETTINGS.items():
                watch = None if every is None else desync.watch(check_every=every)
                steps = train_worker(cfg)["step_times"][1:]
                if watch is not None:
                    watch.stop()
                times.setdefault(f"stage {cfg.stage}, {name}", []).extend(steps)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minizero.lab.desync_cost", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="8M")
    p.add_argument("--stages", default="2,3")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    cfgs = [TrainConfig(stage=int(s), world_size=args.world_size, steps=args.steps, model=args.size)
            for s in args.stages.split(",")]
    ranks = launch(cost_worker, args.world_size, cfgs, args.repeats, stall_timeout=None, check_every=0)
    slowest = {key: [max(step) for step in zip(*(r[key] for r in ranks))] for key in ranks[0]}
    for cfg in cfgs:
        off = statistics.median(slowest[f"stage {cfg.stage}, off"])
        for name in SETTINGS:
            median = statistics.median(slowest[f"stage {cfg.stage}, {name}"])
            print(f"{args.size} stage {cfg.stage} N={args.world_size}  watch {name:>9}: "
                  f"{median * 1e3:8.1f} ms/step  ({(median / off - 1) * 100:+.1f} %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
