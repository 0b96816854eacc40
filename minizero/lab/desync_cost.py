"""What minizero.beyond.desync costs a training step, measured two ways.

    python -m minizero.bench --desync                          # 8M, stages 2 and 3, N = 2
    python -m minizero.bench --desync --size 8M --stages 3 --world-size 2 --steps 8 --repeats 3

1. Per collective: a loop of small blocking all-reduces, in turns with the watch off, on without
   checks (the recorder and the watchdog only), agreeing every 64 collectives, and with the default
   check_every, which agrees before every blocking collective (all of the loop's). The CPU seconds
   this process spends per collective (time.process_time: the main thread and the watchdog's, not
   the time spent waiting for the other rank, which a shared machine's load inflates), added by the
   watch, times the collectives of one training step, over that step's time: for the default an
   upper bound, as a step's asynchronous collectives are not agreed on one by one ([Note: where to
   agree] in beyond/desync.py).
2. Whole steps: the same training steps with the watch off and on, in turns (one launch with the
   launcher's watch off; each rank turns a watch on and off itself), the slowest rank's median.
   Honest but noisy: on a loaded machine run-to-run noise is larger than the cost.
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace

import torch


from minizero import comm
from minizero.lab.record import recorded
from minizero.beyond import desync
from minizero.lab.train import TrainConfig, train_worker

# check_every: None the watch off, 0 the recorder and watchdog only, 1 the default
SETTINGS = {"off": None, "no checks": 0, "every 64": 64, "every 1": 1}
CALLS = 1024         # all-reduces per turn of the loop (a multiple of every check_every above)


def _watched(every: int | None, run):
    watch = None if every is None else desync.watch(check_every=every)
    try:
        return run()
    finally:
        if watch is not None:
            watch.stop()


def cost_worker(cfgs: list[TrainConfig], repeats: int) -> dict:
    """This rank's CPU seconds per small all-reduce and wall seconds per training step, by
    setting; and the collectives in one step of each config."""
    x = torch.zeros(4)

    def loop() -> float:
        start = time.process_time()
        for _ in range(CALLS):
            comm.all_reduce(x)
        return (time.process_time() - start) / CALLS

    out: dict = {"collectives": {}}
    for cfg in cfgs:        # a step's: two steps' less one's (set-up broadcasts every parameter)
        counts = []
        for steps in (1, 2):
            with recorded("collective") as log:
                train_worker(replace(cfg, steps=steps))
            counts.append(len(log))
        out["collectives"][cfg.stage] = counts[1] - counts[0]
    for _ in range(repeats):
        for name, every in SETTINGS.items():
            out.setdefault(f"call, {name}", []).append(_watched(every, loop))
            for cfg in cfgs:
                steps = _watched(every, functools.partial(train_worker, cfg))["step_times"][1:]
                out.setdefault(f"stage {cfg.stage}, {name}", []).extend(steps)
    return out
