"""Each collective the way the backend implements it and the way minizero.comm runs it, timed side
by side.

    python -m minizero.bench --collectives                       # N = 2 and 4; 1M, 8M, 50M elements
    python -m minizero.bench --collectives --world-size 4 --numel 50e6 --json collectives.json

Why it exists: [Note: collectives on gloo] in minizero/comm.py. On gloo, comm runs reduce-scatter as
an all-reduce (and a copy) and all-gather as N broadcasts, because gloo's own reduce-scatter and
all-gather are slower than those. This measures that claim on the machine at hand, for fp32 tensors
of `numel` elements: each row is the median over `repeats` calls of the slowest rank's time, every
rank starting together (a barrier before each call). "backend's" rows call comm inside
comm.backend_collectives(), so both sides go through the same function and tally the same bytes.
Under NCCL both rows are NCCL's own.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from minizero import comm
from minizero.flat import partition
from minizero.launcher import launch

ROWS = ("all_reduce", "reduce_scatter", "all_gather")      # each: the backend's, then minizero's


def collectives_worker(numels: list[int], repeats: int) -> list[dict]:
    """Per numel: {(collective, "backend" | "minizero"): [seconds per call on this rank]}."""
    torch.set_num_threads(1)
    n, r, device = comm.world_size(), comm.rank(), comm.device()
    out = []
    for numel in numels:
        numel -= numel % n                                   # N equal pieces
        source = torch.randn(numel, generator=torch.Generator().manual_seed(r)).to(device)
        def mine(x):                                         # this rank's piece: [numel / N]
            return partition(x, r, n)
        calls = {"all_reduce": lambda x: comm.all_reduce(x),
                 "reduce_scatter": lambda x: comm.reduce_scatter(mine(x), x),             # in place
                 "all_gather": lambda x: comm.all_gather(x, mine(x))}                     # in place
        times = {}
        for kind in ROWS:
            results = []
            for side, workaround in (("backend", False), ("minizero", True)):
                if kind == "all_reduce" and workaround:
                    continue                                  # one way only
                times[f"{kind} ({side})"] = []
                for _ in range(repeats):
                    x = source.clone()
                    comm.barrier()
                    start = time.perf_counter()
                    with contextlib.nullcontext() if workaround else comm.backend_collectives():
                        calls[kind](x)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times[f"{kind} ({side})"].append(time.perf_counter() - start)
                # what the caller may read: the whole output, or (reduce-scatter) this rank's
                # piece only
                results.append(x if kind != "reduce_scatter" else mine(x))
            assert all(torch.allclose(res, results[0], rtol=1e-5, atol=1e-5) for res in results), \
                f"{kind}: minizero.comm's way and the backend's disagree"
        out.append({"numel": numel, "seconds": times, "backend": comm.backend()})
    return out


def measure(
    world_sizes=(2, 4), numels=(1_000_000, 8_000_000, 50_000_000), repeats: int = 4
) -> dict:
    """{"config": ..., "rows": [{"world_size", "numel", "backend", "ms": {row: median of the
    slowest rank}}]}."""
    rows = []
    for n in world_sizes:
        per_rank = launch(collectives_worker, n, list(numels), repeats)
        for i, first in enumerate(per_rank[0]):
            ms = {
                row: 1e3
                * statistics.median(
                    max(calls) for calls in zip(*(res[i]["seconds"][row] for res in per_rank))
                )
                for row in first["seconds"]
            }
            rows.append(
                {"world_size": n, "numel": first["numel"], "backend": first["backend"], "ms": ms}
            )
    return {"config": {"world_sizes": list(world_sizes), "numels": list(numels), "repeats": repeats,
                       "dtype": "fp32"}, "rows": rows}


def format_table(report: dict) -> str:
    names = list(report["rows"][0]["ms"])
    lines = [
        (
            f"collectives, fp32, median of {report['config']['repeats']} "
            "calls on the slowest rank, ms "
            f"(backend's: comm.backend_collectives(); minizero.comm: [Note: collectives on gloo])"
        ),
        f"{'N':>2} {'elements':>11} {'backend':>7}" + "".join(f"{name:>27}" for name in names),
    ]
    for row in report["rows"]:
        lines.append(f"{row['world_size']:>2} {row['numel']:>11,} {row['backend']:>7}"
                     + "".join(f"{row['ms'][k]:27.1f}" for k in names))
    return "\n".join(lines)
