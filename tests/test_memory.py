"""memory.py: the paper's formulas, and the estimator CLI."""

import subprocess
import sys

import pytest

from minizero.cli.memory import main
from minizero.memory import comm_volume, element_bytes, estimate, estimate_breakdown, measure, optimizer_k


def test_paper_figure_1_numbers():
    # ZeRO paper, figure 1: Ψ = 7.5B, N = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.88 GB
    gb = [estimate(7.5e9, 64, s) / 1e9 for s in range(4)]
    assert gb == pytest.approx([120, 31.4, 16.6, 1.875], abs=0.05)


def test_formulas_by_category():
    psi, n = 1000, 4
    assert estimate_breakdown(psi, n, 0) == {"params": 2000, "grads": 2000, "optimizer": 12000, "offloaded": 0}
    assert estimate_breakdown(psi, n, 1)["optimizer"] == 3000
    assert estimate_breakdown(psi, n, 2)["grads"] == 500
    assert estimate(psi, n, 3) == (2 + 2 + 12) * psi / n
    assert estimate(psi, n, 0, param_bytes=4, grad_bytes=4, k=8) == 16 * psi
    off = estimate_breakdown(psi, n, 3, offload="params")
    assert off["params"] == off["optimizer"] == 0 and off["offloaded"] == (12 + 4 + 2) * psi / n


def test_fp16_is_the_papers_accounting_like_bf16():
    assert element_bytes("fp16") == element_bytes("bf16") == 2 and element_bytes("fp32") == 4
    assert optimizer_k(8, "fp16") == optimizer_k(8, "bf16") == 12 and optimizer_k(8, "fp32") == 8


def test_comm_volume_two_psi_and_three_psi():
    assert comm_volume(100, 4, 0) == comm_volume(100, 4, 2) == 2 * 0.75 * 200
    assert comm_volume(100, 4, 3) == 1.5 * comm_volume(100, 4, 1)


def test_measure_counts_each_storage_once():
    import torch
    a = torch.zeros(10)
    assert measure({"params": [a, a[2:5]], "grads": [a]}) == {"params": 40, "grads": 0}


def test_bad_stage():
    with pytest.raises(ValueError, match="stage"):
        estimate(10, 2, 4)


def test_cli_table(capsys):
    assert main(["--params", "7.5e9", "--world-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "120.00" in out and "1.88" in out and "stage 3" in out


def test_cli_builtin_model(capsys):
    assert main(["--model", "default", "--world-size", "4", "--dtype", "fp32"]) == 0
    assert "202,880" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["--params", "-5", "--world-size", "2"], ["--params", "1e6", "--world-size", "0"],
                                  ["--world-size", "2"], ["--params", "x", "--world-size", "2"]])
def test_cli_bad_input_exits_2(args):
    p = subprocess.run([sys.executable, "-m", "minizero.memory", *args], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.startswith("python -m minizero.memory: error:")
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
