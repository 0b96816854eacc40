"""Step time under the network model (minizero/beyond/network.py): what DDP's overlap and stage 3's
prefetch buy, and how each stage slows down as bandwidth falls. Behind notebooks/08_beyond.ipynb
and tests/test_network.py.

    from minizero.lab.network_runs import RATIOS, measure
    out = measure([("DDP", {"stage": 0}, 1.0),
                   ("DDP, no overlap", {"stage": 0, "overlap": False}, 1.0)])
    out["runs"][0]["step_time_s"], out["runs"][0]["network"], out["compute_s"]

Bandwidth is chosen relative to the machine. One launch first trains the base configuration (DDP)
with no network and measures a step's compute time T (its fastest step); a run's `ratio` ρ then
picks the bandwidth at which that DDP step's all-reduce alone takes ρ·T. What overlap can hide
depends on that ratio, not on Gb/s: a small GPT on CPU processes computes so slowly that at a real
cluster's 100 Gb/s its communication would be a rounding error, and fixing ρ makes the experiment
mean the same on a laptop, in CI and on a GPU. Each run reports the bandwidth it got, so the Gb/s
are there to read.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

from minizero import comm
from minizero.lab.record import recorded
from minizero.lab.model import make_model
from minizero.lab.train import TrainConfig, forward_backward, model_num_params
from minizero.launcher import launch
from minizero.beyond.network import Network, set_network
from minizero.beyond.network import tally as network_tally
from minizero.wrap import wrap

# Several gradient buckets (stage 0) and four blocks as units (stage 3): something to overlap.
BASE = TrainConfig(stage=0, world_size=2, steps=4, batch_size=8, bucket_size=40_000, backend="gloo")
RATIOS = (0.25, 1.0, 4.0)           # communication / compute of a DDP step, for the bandwidth sweep


def _instrument(blocks, events: list, sleep: float) -> None:
    """Hooks on each block, after wrap's (so a stage 3 unit's gather and prefetch come first):
    append (time, "forward i") when its forward ends and (time, "backward i") when its backward
    starts. With `sleep`, each block's forward and backward also take that much longer, asleep:
    compute that a busy CPU cannot stretch, so that the tests' gains are not lost in the noise of
    other processes."""
    def after_forward(i, module, args, output):
        time.sleep(sleep)
        events.append((time.perf_counter(), f"forward {i}"))
        if output.requires_grad:
            output.register_hook(lambda grad: before_backward(i))

    def before_backward(i):
        events.append((time.perf_counter(), f"backward {i}"))
        time.sleep(sleep)

    for i, block in enumerate(blocks):
        block.register_forward_hook(functools.partial(after_forward, i))


def _train(cfg: TrainConfig, block_sleep: float = 0.0) -> dict:
    """cfg.steps steps, each timed and recorded: its blocks' forward and backward events
    (_instrument) and the transfers on this rank's modelled link (beyond/network.py's "collective
    modeled" events). The step time reported is the fastest after the first (a warm-up), with its
    timeline: other work on a shared CPU slows steps down at random and never speeds one up, so the
    minimum of a few steps is the steadiest statistic (timeit's)."""
    model = make_model(cfg.model_config(), seed=cfg.seed)
    engine = wrap(
        model, cfg.stage, cfg.optimizer_factory(), offload=cfg.offload, **cfg.engine_options()
    )
    marks: list = []
    _instrument(model.blocks, marks, block_sleep)

    def backward(loss):
        engine.backward(loss)
        marks.append((time.perf_counter(), "end of backward"))

    times, timelines, losses = [], [], []
    for step in range(cfg.steps):
        comm.reset_tally()
        marks.clear()
        start = time.perf_counter()
        with recorded("collective modeled") as issued:
            losses.append(forward_backward(cfg, step, engine, backward, engine.no_sync))
            engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        transfers = [(f["start"] - start, f["end"] - start, f["kind"]) for _, _, f in issued]
        timelines.append({"events": [(t - start, event) for t, event in marks],
                          "transfers": transfers, "end": times[-1]})
    fastest = min(range(1, cfg.steps), key=times.__getitem__)
    return {
        "step_times": times,
        "step_time_s": times[fastest],
        "timeline": timelines[fastest],
        "losses": losses,
        "comm": network_tally(),
        "num_params": model_num_params(engine),
        "world_size": cfg.world_size,
    }


def step_time_worker(base: TrainConfig, runs: list[tuple[str, dict, float | None]], latency: float,
                     ranks_per_node: int, block_sleep: float = 0.0) -> dict:
    """Worker: `base` (stage 0) with no network gives the compute time T of a step and the bytes of
    its all-reduce S; then each run (label, TrainConfig overrides, ratio ρ or None: no network)
    under a network whose bandwidth makes S take ρ·T."""
    _train(base, block_sleep)                  # a warm-up run: the first run of a process is slower
    calibration = _train(base, block_sleep)
    compute = max(comm.all_gather_object(calibration["step_time_s"]))    # every rank the same model
    sent = calibration["comm"]["total"]
    out = {"compute_s": compute, "allreduce_bytes": sent, "runs": []}
    for label, overrides, ratio in runs:
        network = (
            None
            if ratio is None
            else Network(
                bandwidth=sent / (ratio * compute), latency=latency, ranks_per_node=ranks_per_node
            )
        )
        set_network(network)
        try:
            result = _train(dataclasses.replace(base, **overrides), block_sleep)
        finally:
            set_network(None)
        out["runs"].append(
            {
                "label": label,
                "ratio": ratio,
                "network": None if network is None else str(network),
                "bandwidth": None if network is None else network.bandwidth,
                "stage": overrides.get("stage", base.stage),
                **result,
            }
        )
    return out


def measure(
    runs: list[tuple[str, dict, float | None]],
    base: TrainConfig = BASE,
    latency: float = 10e-6,
    ranks_per_node: int = 1,
    block_sleep: float = 0.0,
) -> dict:
    """One launch of `base.world_size` ranks: rank 0's step_time_worker result
    (block_sleep: _slow_down)."""
    return launch(
        step_time_worker, base.world_size, base, runs, latency, ranks_per_node, block_sleep,
        backend=base.backend,
    )[0]


def overlap_runs(ratio: float = 1.0) -> list[tuple[str, dict, float]]:
    """DDP with and without overlap, stage 3 with and without prefetch, all at one ratio."""
    return [
        ("DDP", {"stage": 0}, ratio),
        ("DDP, no overlap", {"stage": 0, "overlap": False}, ratio),
        ("stage 3", {"stage": 3}, ratio),
        ("stage 3, no prefetch", {"stage": 3, "prefetch": False}, ratio),
    ]


def sweep_runs(ratios=RATIOS, stages=(0, 1, 2, 3)) -> list[tuple[str, dict, float | None]]:
    """Every stage with no network and at each ratio (the bandwidth falls as the ratio grows)."""
    return [(f"stage {s}, ratio {r}", {"stage": s}, r) for s in stages for r in (*ratios, None)]


def by_label(out: dict) -> dict[str, dict]:
    return {run["label"]: run for run in out["runs"]}


def predict(out: dict, bandwidth: float) -> dict[int, dict]:
    """What the model predicts per stage at `bandwidth` (bytes/s) from the no-network runs of a
    sweep: its compute T (fastest step) and bytes per step S, so communication C = S / bandwidth
    (hops' latency left out). A step takes between max(T, C) (everything hidden) and T + C
    (nothing hidden)."""
    predicted = {}
    for run in out["runs"]:
        if run["ratio"] is None:
            compute, sent = run["step_time_s"], run["comm"]["total"]
            c = sent / bandwidth
            predicted[run["stage"]] = {
                "compute_s": compute,
                "comm_s": c,
                "hidden_s": max(compute, c),
                "serial_s": compute + c,
            }
    return predicted
