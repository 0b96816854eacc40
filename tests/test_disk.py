"""The disk tier (minizero/beyond/disk.py): bitwise the in-memory optimizer at stages 1-3 (fp32,
bf16), its file as large as the formula says, no file ever left in the folder (a rank killed too),
checkpoints resume bit-identically, one-line errors for a bad folder."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys

import pytest
import torch
from _checks import AWKWARD

import minizero
from minizero import checkpoint
from minizero.beyond.disk import DiskShardOptimizer, check_folder
from minizero.lab.faults import Fault
from minizero.lab.report import theory
from minizero.lab.train import TrainConfig, train_several
from minizero.memory import CATEGORIES, within_padding
from minizero.homes import DeviceHome

N = 2


class SmallPieces(DiskShardOptimizer):
    piece_numel = 1  # one view a piece: buckets cut into several pieces, many pieces in flight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "optimizer",
    [
        functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
        functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    ],
)
def test_pieces_step_bitwise_like_memory(tmp_path, dtype, optimizer):
    """Two buckets of 4 + 1 cache-sized views, one view a piece: masters, state and parameters
    equal the in-memory optimizer's after 3 steps, and after a state_dict round trip into a fresh
    one (what a checkpoint does)."""
    torch.manual_seed(0)
    values = [torch.randn(1_100_000).to(dtype), torch.randn(300_001).to(dtype)]  # 4 + 1 views
    grads = [[torch.randn(v.numel()).to(dtype) for v in values] for _ in range(4)]
    parts = {"memory": [v.clone() for v in values], "disk": [v.clone() for v in values]}
    memory = DeviceHome(parts["memory"], optimizer)     # checkpointable: state_dict
    disk = SmallPieces(parts["disk"], optimizer, folder=tmp_path)
    assert len(disk.pieces) == 5  # more than the 3 slots: they are reused
    for g in grads[:3]:
        memory.step(g)
        disk.step(g)
    fresh_parts = [v.clone() for v in parts["disk"]]
    fresh = SmallPieces(fresh_parts, optimizer, folder=tmp_path)
    fresh.load_state_dict(disk.state_dict())
    for m, v in zip(fresh.masters, disk.master_values()):  # what checkpoint._restore does
        m.data.copy_(v)
    for opt in (memory, disk, fresh):
        opt.step(grads[3])
    want = memory.state_dict()["state"]
    for opt, mine in ((disk, parts["disk"]), (fresh, fresh_parts)):
        assert all(torch.equal(a, b) for a, b in zip(memory.master_values(), opt.master_values()))
        assert all(torch.equal(a, b) for a, b in zip(parts["memory"], mine))
        got = opt.state_dict()["state"]
        for b in want:
            for name, value in want[b].items():
                assert torch.equal(value, got[b][name]), f"bucket {b}, {name}"
    assert os.listdir(tmp_path) == []  # nameless files (O_TMPFILE)


def _runs(folder, saved) -> dict[str, TrainConfig]:
    """Disk and memory at stages 1-3, fp32 and bf16, on the awkward GPT; the 1M GPT at stage 3
    in bf16 for the formula; a checkpoint saved after 2 steps and resumed for the third."""
    base = {"world_size": N, "steps": 3, "batch_size": 8, "return_state": True,
            "optimizer": "adamw", "lr": 1e-2, **AWKWARD}
    runs = {}
    for stage in (1, 2, 3):
        for dtype in ("fp32", "bf16"):
            for offload in (False, "disk"):
                path = str(folder) if offload else None
                runs[(stage, dtype, offload)] = TrainConfig(
                    stage=stage, dtype=dtype, offload=offload, offload_path=path, **base
                )
    big = {"stage": 3, "dtype": "bf16", "world_size": N, "steps": 2, "batch_size": 4, "model": "1M",
           "return_state": True}
    runs["1M"] = TrainConfig(**big)
    runs["1M disk"] = TrainConfig(**big, offload="disk", offload_path=str(folder))
    disk = runs[(3, "bf16", "disk")]
    runs["saved"] = dataclasses.replace(disk, steps=2, save_dir=str(saved), return_state=False)
    runs["resumed"] = dataclasses.replace(disk, load_dir=str(saved))
    runs["resumed in memory"] = dataclasses.replace(runs[(3, "bf16", False)], load_dir=str(saved))
    return runs


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("state")
    runs = _runs(folder, tmp_path_factory.mktemp("checkpoint"))
    per_rank = minizero.launch(train_several, N, list(runs.values()))
    return folder, {
        name: (cfg, [r[i] for r in per_rank]) for i, (name, cfg) in enumerate(runs.items())
    }


def _assert_same_state(a: list[dict], b: list[dict], what: str) -> None:
    for ra, rb in zip(a, b):
        for key, value in ra["state_dict"].items():
            assert torch.equal(value, rb["state_dict"][key]), (
                f"{what}, rank {ra['rank']}: {key} differs"
            )


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_bitwise_like_memory(launched, stage, dtype):
    _, runs = launched
    _assert_same_state(
        runs[(stage, dtype, False)][1],
        runs[(stage, dtype, "disk")][1],
        f"stage {stage} {dtype}, disk vs memory",
    )


def test_1m_gpt_bitwise_and_memory_is_the_formula(launched):
    """Ψ ≈ 1M, bf16 stage 3: the file holds KΨ/N = 12Ψ/N bytes (up to a block a piece), memory
    holds no optimizer state; parameters and gradients as in memory."""
    _, runs = launched
    _assert_same_state(runs["1M"][1], runs["1M disk"][1], "1M GPT, disk vs memory")
    cfg, results = runs["1M disk"]
    th = theory(cfg, results[0]["num_params"], results[0]["num_frozen"])
    assert (
        th["disk"] == 12 * results[0]["num_params"] / N and th["optimizer"] == th["offloaded"] == 0
    )
    for r in results:
        m = r["memory"]
        for cat in CATEGORIES:
            assert within_padding(m[cat], th[cat], N), (
                f"rank {r['rank']} {cat}: {m[cat]} vs {th[cat]:.0f}"
            )
        pieces = cfg.model_config().n_layer + 1  # one piece a unit: blocks and the rest
        assert within_padding(m["disk"], th["disk"], N, blocks=pieces), (
            f"disk: {m['disk']} vs {th['disk']:.0f}"
        )


def test_checkpoint_resumes_bit_identically(launched):
    """Saved after 2 steps with the disk tier, resumed for the third with it and without it."""
    _, runs = launched
    for name in ("resumed", "resumed in memory"):
        _assert_same_state(runs[(3, "bf16", "disk")][1], runs[name][1], f"saved after 2, {name}")


def test_no_file_left_in_the_folder(launched):
    folder, _ = launched
    assert os.listdir(folder) == []


def test_a_rank_killed_mid_run_leaves_no_file_and_the_run_resumes(launched, tmp_path):
    """Rank 1 is SIGKILLed at step 2 (as the OOM killer would), checkpoints every step: the folder
    is empty (the kernel freed the nameless files), and resuming from the newest complete
    checkpoint ends bit-identical to the uninterrupted run."""
    folder, runs = launched
    cfg, uninterrupted = runs[(3, "bf16", "disk")]
    run_dir = str(tmp_path / "run")
    killed = dataclasses.replace(
        cfg, save_dir=run_dir, save_every=1, fault=Fault(rank=1, step=2, mode="kill")
    )
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        minizero.launch(train_several, N, [killed])
    assert os.listdir(folder) == []
    newest = checkpoint.latest(run_dir)
    assert newest.endswith("step-000002")
    resumed = minizero.launch(train_several, N, [dataclasses.replace(cfg, load_dir=newest)])
    _assert_same_state(uninterrupted, [r[0] for r in resumed], "killed at step 2, resumed")


def test_bad_folder_is_one_line(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="is not an existing folder"):
        minizero.wrap(
            torch.nn.Linear(2, 2),
            2,
            functools.partial(torch.optim.SGD, lr=0.1),
            offload="disk",
            offload_path=str(missing),
        )
    with pytest.raises(ValueError, match="needs offload_path"):
        check_folder(None)
    with pytest.raises(ValueError, match="needs offload='disk'"):
        minizero.wrap(
            torch.nn.Linear(2, 2),
            2,
            functools.partial(torch.optim.SGD, lr=0.1),
            offload_path=str(tmp_path),
        )
    with pytest.raises(ValueError, match="offload needs ZeRO stage 1, 2 or 3"):
        minizero.wrap(
            torch.nn.Linear(2, 2),
            0,
            functools.partial(torch.optim.SGD, lr=0.1),
            offload="disk",
            offload_path=str(tmp_path),
        )


@pytest.mark.parametrize("args", [["--offload-path", "/nonexistent/folder"], ["--layers", "0"]])
def test_infinity_bad_input_is_one_line(args):
    p = subprocess.run([sys.executable, "-m", "minizero.scale", "--infinity", *args],
                       capture_output=True, text=True, check=False)
    assert p.returncode == 2 and p.stderr.startswith("python -m minizero.scale --infinity: error:")
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
