"""memory.py: the paper's formulas, and the estimator CLI."""

import subprocess
import sys

import pytest

from minizero.cli.memory import main
from minizero.lab import deepspeed_peer
from minizero.lab.model import GPT, MODEL_NAMES, GPTConfig, count_params
from minizero.memory import mesh
from minizero.memory.mesh import estimate_mesh, params_per_rank
from minizero.memory import (
    activation_bytes, comm_volume, disk_traffic, element_bytes, estimate, estimate_breakdown,
    grad_bytes, measure, optimizer_k,
)


def test_paper_figure_1_numbers():
    # ZeRO paper, figure 1: Ψ = 7.5B, N = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.88 GB
    gb = [estimate(7.5e9, 64, s) / 1e9 for s in range(4)]
    assert gb == pytest.approx([120, 31.4, 16.6, 1.875], abs=0.05)


def test_formulas_by_category():
    psi, n = 1000, 4
    assert estimate_breakdown(psi, n, 0) == {"params": 2000, "grads": 2000, "optimizer": 12000,
                                             "offloaded": 0, "disk": 0}
    assert estimate_breakdown(psi, n, 1)["optimizer"] == 3000
    assert estimate_breakdown(psi, n, 2)["grads"] == 500
    assert estimate(psi, n, 3) == (2 + 2 + 12) * psi / n
    assert estimate(psi, n, 0, param_bytes=4, grad_bytes=4, k=8) == 16 * psi
    off = estimate_breakdown(psi, n, 3, offload="params")
    assert off["params"] == off["optimizer"] == 0 and off["offloaded"] == (12 + 4 + 2) * psi / n


def test_disk_tier_formula():
    """ZeRO-Infinity's disk tier: the KΨ/N of optimizer state move to disk, read and written once
    a step; fp32 parameters stay their own master (K = 8), unlike the host tier's (K = 12)."""
    psi, n = 1000, 4
    b = estimate_breakdown(psi, n, 3, offload="disk")
    assert b == {"params": 500, "grads": 500, "optimizer": 0, "offloaded": 0, "disk": 3000}
    assert estimate(psi, n, 3, offload="disk") == 4 * psi / n
    assert disk_traffic(psi, n) == {"read": 3000, "written": 3000}
    assert optimizer_k(8, "fp32", "disk") == 8 and optimizer_k(8, "fp32", "optimizer") == 12
    assert optimizer_k(8, "bf16", "disk") == 12


def test_cli_what_if_architecture(capsys):
    """GPT-2 XL counted on the meta device (its published 1.56B), the tiers, and DeepSpeed's
    estimate for it: 18Ψ/N + 4 bytes of the largest layer (the 50257 x 1600 embedding) a device."""
    assert main(["--model", "gpt2-xl", "--world-size", "2", "--seq", "1024", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    psi, largest = 1_557_611_200, 50257 * 1600
    assert f"Ψ = {psi:,} parameters" in out
    assert "stage 3 + disk             3.12       0.00       9.35" in out
    if not deepspeed_peer.available():      # the README's fresh machine: no .[peers]
        assert out.rstrip().endswith("DeepSpeed is not installed: no comparison")
        return
    assert f"largest layer {largest:,}" in out
    assert f"{(18 * psi / 2 + 4 * largest) / 1e9:.2f} GB" in out


def test_fp16_is_the_papers_accounting_like_bf16():
    assert element_bytes("fp16") == element_bytes("bf16") == 2 and element_bytes("fp32") == 4
    assert optimizer_k(8, "fp16") == optimizer_k(8, "bf16") == 12 and optimizer_k(8, "fp32") == 8


def test_comm_volume_two_psi_and_three_psi():
    assert comm_volume(100, 4, 0) == comm_volume(100, 4, 2) == 2 * 0.75 * 200
    assert comm_volume(100, 4, 3) == 1.5 * comm_volume(100, 4, 1)
    # reduce_dtype="fp32": the gradient collectives (DDP's all-reduce, the reduce-scatter)
    # at 4 bytes
    assert grad_bytes("bf16") == 2 and grad_bytes("bf16", "fp32") == grad_bytes("fp32") == 4
    assert comm_volume(100, 4, 0, grad_bytes=4) == 2 * comm_volume(100, 4, 0)
    assert comm_volume(100, 4, 2, grad_bytes=4) == 0.75 * (100 * 4 + 100 * 2)
    assert comm_volume(100, 4, 3, grad_bytes=4, frozen=10) == 0.75 * (100 * 4 + 220 * 2)


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


def test_gpt_activations_with_checkpointing_are_the_papers_8_gb():
    # ZeRO paper, section 6.1: GPT-2 1.5B (48 layers, h = 1600), sequence 1K, batch 32, ~8 GB
    # checkpointed (one block input per layer, 2-byte elements; plus here one block's recompute)
    gb = activation_bytes(48, 1600, 25, 1024, 32, bytes_per_elem=2, checkpointing=True) / 1e9
    assert 8 <= gb <= 8.5
    # all of it kept: 161 GB, the attention scores (a·s/h = 16 per element of s·b·h) as much as the
    # rest; the paper's 60 GB is its rough 12·h·b·s per layer, which leaves them out
    assert activation_bytes(48, 1600, 25, 1024, 32, bytes_per_elem=2) / 1e9 == pytest.approx(
        161.33, abs=0.01
    )


@pytest.mark.parametrize("overrides", [{}, {"tie_weights": False, "unused_param": True}])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_count_params_is_what_the_gpt_holds(name, overrides):
    cfg = GPTConfig.named(name, **overrides)
    assert count_params(cfg) == GPT(cfg).num_params()


def test_cli_gpt_shape_adds_activations(capsys):
    assert (
        main(
            [
                "--layers", "48", "--hidden", "1600", "--heads", "25", "--seq", "1024", "--batch",
                "32", "--world-size", "64",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "Ψ = 1,557,611,200 parameters" in out
        and "checkpointed 8.29" in out
        and "+ ckpt on host" in out
    )


def test_cli_json_holds_the_tables_numbers_in_bytes(tmp_path, capsys):
    """--json: each stage's row, its sums with the activations, and stage 3's tiers, as the formulas
    give them (a GPT's shape, part of it frozen, fp32: every column of the table in play)."""
    import json
    path = tmp_path / "memory.json"
    shape = ["--layers", "4", "--hidden", "256", "--heads", "4", "--seq", "128", "--batch", "8"]
    assert main([*shape, "--world-size", "4", "--frozen", "1e5", "--dtype", "fp32",
                 "--json", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    r = json.loads(path.read_text())
    psi = count_params(GPTConfig(n_layer=4, n_embd=256, n_head=4, block_size=128,
                                 vocab_size=50257))
    k = optimizer_k(8, "fp32")
    sizes = dict(param_bytes=4, grad_bytes=4, k=k, frozen=100_000)
    assert (r["params"], r["frozen"], r["world_size"], r["dtype"]) == (psi, 100_000, 4, "fp32")
    assert r["bytes_per_param"] == {"params": 4, "grads": 4, "optimizer_k": k}
    assert r["activations"]["kept"] == activation_bytes(4, 256, 4, 128, 8, bytes_per_elem=4)
    assert [s["stage"] for s in r["stages"]] == [0, 1, 2, 3]
    for s in r["stages"]:
        b = estimate_breakdown(psi - 100_000, 4, s["stage"], **sizes)
        total = estimate(psi - 100_000, 4, s["stage"], **sizes)
        assert (s["params"], s["grads"], s["optimizer"]) == (b["params"], b["grads"],
                                                             b["optimizer"])
        assert s["total"] == pytest.approx(total)
        assert s["with_activations"] == {n: pytest.approx(s["total"] + a)
                                         for n, a in r["activations"].items()}
    assert [t["offload"] for t in r["tiers"]] == ["optimizer", "params", "disk"]
    disk = r["tiers"][2]
    assert disk["host"] == 0 and disk["disk"] == pytest.approx(k * (psi - 100_000) / 4)
    assert r["deepspeed"] is None                     # DeepSpeed's estimate is for --model only


@pytest.mark.parametrize(
    "args",
    [
        ["--params", "-5", "--world-size", "2"],
        ["--params", "1e6", "--world-size", "0"],
        ["--world-size", "2"],
        ["--params", "x", "--world-size", "2"],
        ["--layers", "4", "--hidden", "64", "--world-size", "2"],
        [
            "--layers", "4", "--hidden", "64", "--heads", "3", "--seq", "8", "--batch", "2",
            "--world-size", "2",
        ],
    ],
)
def test_cli_bad_input_exits_2(args):
    p = subprocess.run(
        [sys.executable, "-m", "minizero.memory", *args], capture_output=True, text=True
    )
    assert p.returncode == 2 and p.stderr.startswith("python -m minizero.memory: error:")
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr


def test_the_papers_table1_with_model_parallelism(capsys):
    """ZeRO paper, Table 1 (32 GB V100s, 64-way data parallelism): the largest model per stage for
    M = 1 ... 16, in billions. The paper rounds (its M = 2 row doubles M = 1's 7.6): 1 % apart."""
    paper = {1: (2, 7.6, 14.4, 128), 2: (4, 15.2, 28.8, 256), 4: (8, 30.4, 57.6, 512),
             8: (16, 60.8, 115.2, 1024), 16: (32, 121.6, 230.4, 2048)}
    for row in mesh.table1():
        for got, want in zip(row["largest"], paper[row["model_parallel"]]):
            assert got / 1e9 == pytest.approx(want, rel=0.01), row
    assert main(["--table1"]) == 0
    out = capsys.readouterr().out
    assert "   1     64        2.0        7.6       14.4      128.0" in out


def test_cli_with_tensor_parallelism(capsys):
    """--tensor-parallel M: each rank's model is Ψ/M, ZeRO shards it over N_d = N/M: stage 3 holds
    (2 + 2 + K)Ψ/(M·N_d)."""
    psi, m, n = 7.5e9, 8, 64
    assert main(["--params", str(psi), "--world-size", str(n), "--tensor-parallel", str(m)]) == 0
    out = capsys.readouterr().out
    assert "M = 8 tensor-parallel ranks), N_d = 8 (N = 64)" in out
    assert f"{16 * psi / n / 1e9:11.2f}{1.0 * 16 / (16 / 8):8.1f}x" in out
    assert estimate_mesh(psi, m, n // m, 3) == 16 * psi / n
    assert params_per_rank(split=96, replicated=5, tensor_parallel=4) == 29
    assert main(["--params", "1e9", "--world-size", "64", "--tensor-parallel", "3"]) == 2
    assert "--tensor-parallel must divide --world-size 64, got 3" in capsys.readouterr().err
