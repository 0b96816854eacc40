"""Bytes on the wire, measured (minizero/memory/wire.py) next to the ring's, modelled (comm.tally).

    python -m pytest tests/test_wire.py

On 2 gloo ranks each collective, run alone, puts on the wire what gloo sends for it (an all-reduce
for a reduce-scatter, N broadcasts for an all-gather: [Note: collectives on gloo] in comm.py) plus a
few headers; a training step's total is the tally's with the reduce-scatters doubled; bytes written
while collectives of two kinds are in flight are "overlapped"; and `python -m minizero.run --json`
holds both figures. Two launches and one run of the CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import minizero
from minizero import comm
from minizero.lab import demo
from minizero.lab.report import format_table
from minizero.lab.train import TrainConfig, train_several
from minizero.memory import wire

pytestmark = pytest.mark.skipif(not os.path.isdir(wire.TASKS), reason="no /proc/self/task here")
N = 2
# gloo's headers, per collective and rank, at most (measured here: 144 B for an all-gather of 40 kB
# on 2 ranks, 576 B for an all-reduce; docs/performance.md)
HEADERS = 1024


@pytest.fixture(scope="module")
def collectives():
    return minizero.launch(demo.collectives_worker, N, 10_000, 1)


def gloo_bytes(kind: str, full_bytes: int, n: int, rank: int) -> float:
    """What gloo sends for one of comm's collectives, headers aside: the ring's bytes, except a
    reduce-scatter (an all-reduce underneath) and a broadcast (its root sends the whole tensor to
    each of its children: on 2 ranks, S from rank 0, nothing from rank 1)."""
    if kind == "reduce_scatter":
        return comm.ring_bytes("all_reduce", full_bytes, n)
    if kind == "broadcast":
        assert n == 2
        return full_bytes if rank == 0 else 0
    return comm.ring_bytes(kind, full_bytes, n)


def test_each_collective_alone_puts_gloos_bytes_on_the_wire(collectives):
    for rank, res in enumerate(collectives):
        assert res["wire_unavailable"] is None
        for kind in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
            want, got = gloo_bytes(kind, res["full_bytes"], N, rank), res["wire"][kind]
            assert want <= got <= want + HEADERS, f"rank {rank}, {kind}: {got} B, gloo sends {want}"
        # the teaching ring: what it hands to send (the tally counts exactly its chunks)
        want, got = res["sent"]["ring_all_reduce"], res["wire"]["ring_all_reduce"]
        assert want <= got <= want + HEADERS, f"rank {rank}, ring_all_reduce: {got} B, sent {want}"


@pytest.fixture(scope="module")
def steps():
    cfgs = [TrainConfig(stage=stage, steps=1, model="default", batch_size=8) for stage in range(4)]
    return minizero.launch(train_several, N, cfgs)


@pytest.mark.parametrize("stage", range(4))
def test_a_steps_bytes_are_the_tallys_with_the_reduce_scatters_doubled(steps, stage):
    """Measured / modelled per step: 1 at stage 0, 1.5 at stages 1-2 (Ψ + 2Ψ against Ψ + Ψ), 4/3 at
    stage 3 (Ψ + Ψ + 2Ψ against 3Ψ), within the headers; per kind, where nothing overlapped."""
    ratio = {0: 1.0, 1: 1.5, 2: 1.5, 3: 4 / 3}[stage]
    for rank, res in enumerate(step[stage] for step in steps):
        modelled, measured = res["comm_bytes_per_step"], res["wire_bytes_per_step"]
        assert measured["total"] / modelled["total"] == pytest.approx(ratio, rel=0.01), (
            f"stage {stage}, rank {rank}: {measured} against the tally's {modelled}")
        if measured["overlapped"] == 0:
            for kind in ("all_reduce", "reduce_scatter", "all_gather"):
                want = modelled.get(kind, 0) * (2 if kind == "reduce_scatter" else 1)
                assert want <= measured.get(kind, 0) <= 1.01 * want, (stage, rank, kind)


def overlapping() -> dict:
    """Worker: an all-reduce and an all-gather in flight together (async), then waited."""
    x, full = torch.ones(10_000), torch.empty(10_000)
    with wire.WireMeter() as meter:
        first = comm.all_reduce(x, async_op=True)
        second = comm.all_gather(full, x[comm.rank() * 5_000:][:5_000].clone(), async_op=True)
        # the second waited first: the all-reduce stays in flight until the end, so the
        # all-gather is never alone in flight, whatever the machine's load (waiting the first
        # first let a loaded machine send part of the all-gather after it: not overlapped)
        second.wait()
        first.wait()
        return meter.bytes()


def test_bytes_sent_while_two_kinds_are_in_flight_are_overlapped():
    """The all-gather's bytes go out while the all-reduce is still in flight (waited last): they
    are "overlapped", never the all-gather's; the all-reduce's went out before the all-gather was
    issued (its own, on a quick machine) or after (overlapped); the total is both collectives'."""
    for rank, got in enumerate(minizero.launch(overlapping, N)):
        gathered = comm.ring_bytes("all_gather", 40_000, N)
        both = comm.ring_bytes("all_reduce", 40_000, N) + gathered
        assert got.get("all_gather", 0) == 0 and got["overlapped"] >= gathered, (rank, got)
        assert got["total"] == got.get("all_reduce", 0) + got["overlapped"], (rank, got)
        assert both <= got["total"] <= both + 2 * HEADERS, (rank, got)


def test_the_runs_json_holds_the_modelled_and_the_measured_bytes(tmp_path):
    out = tmp_path / "run.json"
    run = subprocess.run([sys.executable, "-m", "minizero.run", "--stage", "1", "--world-size",
                          str(N), "--steps", "1", "--model", "tiny", "--quiet", "--json",
                          str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["wire_unavailable"] is None
    for rank in summary["ranks"]:
        modelled, measured = rank["comm_bytes_per_step"], rank["wire_bytes_per_step"]
        assert modelled["reduce_scatter"] > 0 and modelled["all_gather"] > 0, modelled
        assert measured["reduce_scatter"] >= 2 * modelled["reduce_scatter"], measured
        assert measured["all_gather"] >= modelled["all_gather"], measured
    assert "measured" in run.stdout and "modelled" in run.stdout, run.stdout


def test_where_it_cannot_measure_the_table_says_n_a(collectives):
    """No /proc (not Linux) or NCCL: the measured figures are None and the table prints n/a."""
    summary = {**SUMMARY, "wire_unavailable": "nccl sends by DMA, not through write calls",
               "ranks": [{**r, "wire_bytes_per_step": None} for r in SUMMARY["ranks"]]}
    table = format_table(summary)
    assert "n/a" in table and "nccl sends by DMA" in table, table


SUMMARY = {
    "stage": 1, "world_size": 2, "backend": "nccl", "device": "cuda", "num_params": 10,
    "num_frozen": 0, "dtype": "fp32", "reduce_dtype": None, "offload": False, "losses": [2.0, 1.0],
    "shard_group_size": None, "hpz_group_size": None, "tensor_parallel": 1, "network": None,
    "ranks": [{"rank": r, "comm_bytes_per_step": {"reduce_scatter": 20.0, "all_gather": 20.0,
                                                  "total": 40.0},
               "memory": dict.fromkeys(("params", "grads", "optimizer", "offloaded", "peak",
                                        "activations"), 0)} for r in range(2)],
    "theory": dict.fromkeys(("params", "grads", "optimizer", "offloaded", "device_total",
                             "activations", "comm_bytes_per_step"), 0.0),
    "step_time_s": 0.01, "loss_scale": 1.0, "skipped_steps": 0,
    "throughput": {"tokens_per_s": 1.0, "tokens_per_s_per_rank": 0.5, "flops_per_s": 1.0,
                   "mfu": None},
}
