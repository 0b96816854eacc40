"""tests/test_cuda.py's runs rehearsed on CPU (gloo, N = 2), so that they cannot rot unseen between
GPU machines: its configurations and its Hugging Face cases still train to the single-process
reference; and scripts/gpu_smoke.sh starts (and stops, saying why, without a GPU).

    python -m pytest tests/test_cuda_rehearsal.py -q      # skipped where CUDA is: test_cuda runs

What only a GPU can show (NCCL, the allocator, pinned memory, streams) stays in test_cuda.py. This
rehearsal found the first version of its configurations failing at every stage: AdamW's default
weight decay moved the awkward GPT's unused parameter here and not in the reference.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from _checks import assert_matches_reference
from _hf import Case, reference_train, train_cases
from test_cuda import SETTINGS, TRAINED, configs, name

import minizero
from minizero.lab.reference import max_abs_diff, tolerance
from minizero.lab.train import train_several

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CUDA is here: tests/test_cuda.py runs these on the GPU")
N = 2
HF_CASES = {name(setting, "fp32"): Case("gpt2", *setting, world_size=N) for setting in SETTINGS}


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[object, list[dict]]]:
    """test_cuda's trained runs and its Hugging Face cases in one launch over gloo."""
    every = configs(N)
    trained = {run: every[f"trained/{run}"] for run in TRAINED}
    per_rank = minizero.launch(_rehearse, N, list(trained.values()), list(HF_CASES.values()))
    out = {run: (cfg, [ranks[0][i] for ranks in per_rank])
           for i, (run, cfg) in enumerate(trained.items())}
    out |= {f"hf/{run}": (case, [ranks[1][i] for ranks in per_rank])
            for i, (run, case) in enumerate(HF_CASES.items())}
    return out


def _rehearse(cfgs: list, cases: list) -> tuple[list[dict], list[dict]]:
    return train_several(cfgs), train_cases(cases)


@pytest.mark.parametrize("run", TRAINED)
def test_trained_run_matches_reference(runs, run):
    cfg, results = runs[run]
    assert_matches_reference(cfg, results, atol=tolerance(cfg.dtype))


@pytest.mark.parametrize("run", HF_CASES)
def test_hf_gpt2_matches_reference(runs, run):
    case, results = runs[f"hf/{run}"]
    expected = reference_train(case)["state_dict"]
    for r in results:
        diff = max_abs_diff(r["state_dict"], expected)
        assert diff <= tolerance("fp32"), (
            f"{case}, rank {r['rank']}: max |minizero - reference| = {diff:.3g}")


def test_gpu_smoke_finds_python3_and_stops_without_a_gpu(tmp_path):
    """scripts/gpu_smoke.sh without CUDA: exit 2 and one line saying so, before any test runs; also
    where python3 is the only Python on PATH (the H200 image's PyTorch is under python3)."""
    script = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "gpu_smoke.sh"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("timeout", "tee", "grep", "sed", "date", "xargs", "tr", "dirname", "cat"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    python3 = bin_dir / "python3"            # this interpreter (a venv's too), as python3 alone
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"} | {"PATH": str(bin_dir)}
    done = subprocess.run([shutil.which("bash"), str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stderr.splitlines() == [
        f"gpu_smoke: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no GPU"]
