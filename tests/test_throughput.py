"""Throughput and MFU (minizero/lab/throughput.py): FLOPs per token of the default GPT against a
count by hand, the arithmetic of the throughput line, the GEMM peak, and `python -m minizero.bench
--peak`. Run: python -m pytest tests/test_throughput.py -q"""

from __future__ import annotations

import json

import pytest
import torch

from minizero.lab.bench import main as bench_main
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.throughput import (
    flops_per_token,
    gemm_flops_per_s,
    matmul_params,
    throughput,
)


def test_flops_per_token_of_the_default_gpt_by_hand():
    # default GPT: L = 4 blocks, d = 64, MLP ratio 4, vocabulary 12, rows of T = 32 tokens
    # (block_size 32). matmul weights per block: qkv 3d² + proj d² + MLP 2·4d² = 12d² = 49,152; four
    # blocks 196,608; the (tied) head 12·64 = 768: Ψ_mm = 197,376. Attention per token forward:
    # 4·L·T·d = 4·4·32·64 = 32,768.
    assert matmul_params(GPTConfig()) == 197_376
    assert flops_per_token(GPTConfig()) == 6 * 197_376 + 12 * 4 * 32 * 64 == 1_282_560
    # activation checkpointing runs every forward twice: 8Ψ_mm + 16·L·T·d
    assert flops_per_token(GPTConfig(), checkpointing=True) \
        == 8 * 197_376 + 16 * 4 * 32 * 64 == 1_710_080
    # Ψ_mm is the model's nn.Linear weights (the head is the tied embedding), counted from the model
    # itself
    model = make_model(GPTConfig())
    linear = {id(m.weight): m.weight.numel() for m in model.modules()
              if isinstance(m, torch.nn.Linear)}
    assert sum(linear.values()) == matmul_params(GPTConfig())


def test_throughput_line_arithmetic():
    t = throughput(GPTConfig(), batch_size=16, step_time_s=0.1, world_size=2,     # rows of 32
                   peak_flops_per_s=1e11)
    assert t["tokens_per_s"] == pytest.approx(5120)
    assert t["tokens_per_s_per_rank"] == pytest.approx(2560)
    assert t["flops_per_s"] == pytest.approx(5120 * 1_282_560)
    assert t["mfu"] == pytest.approx(5120 * 1_282_560 / 1e11) and 0 < t["mfu"] < 1
    assert throughput(GPTConfig(), 16, 0.1, 2, None)["mfu"] is None


def test_gemm_peak_is_a_rate():
    fast = gemm_flops_per_s("fp32", torch.device("cpu"), size=128, seconds=0.05)
    assert 0 < fast < 1e13                   # a rate, below 10 TFLOP/s on a CPU, however loaded


def test_bench_peak_prints_and_writes_json(tmp_path, capsys):
    out = tmp_path / "peak.json"
    assert bench_main(["--peak", "--world-size", "1", "--dtypes", "fp32", "--json", str(out)]) == 0
    assert "fp32:" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["peak_flops_per_s"]["fp32"] > 0 and len(data["per_rank"]) == 1
    assert bench_main(["--peak", "--dtypes", "fp8"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
