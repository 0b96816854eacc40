"""Throughput of a run: tokens per second, the FLOP/s they mean, and the model-FLOPs utilization
(MFU) against what this machine's cores measurably do.

    python -m minizero.bench --peak [--world-size 2] [--dtypes fp32,bf16] [--device cuda]
    python -m minizero.run --stage 2              # its table ends with a throughput line

FLOPs per token, counted for the small GPT (minizero.lab.model) as Kaplan et al. (2020) and PaLM's
MFU (Chowdhury et al. 2022, appendix B) count them:
  * the matmuls: 2 FLOPs (a multiply and an add) per weight per token forward, for Ψ_mm = the
    weights of every nn.Linear (each block's qkv, proj and both MLP layers: (4 + 2r)d² per layer)
    plus the head (V·d; tied to the token embedding, whose lookup costs nothing). Biases, layer
    norms, GELU, softmax, the position embedding: not counted (a few per cent at these sizes).
  * attention: QKᵀ and AV each 2·T·d per token per layer (T = sequence length): 4·L·T·d forward. The
    full T×T products are counted, because the model computes them all and masks afterwards.
  * backward is twice forward (a gradient for the input and one for the weight): training is
    3 × forward = 6Ψ_mm + 12·L·T·d. With activation checkpointing every block's forward runs again
    in backward: 4 × forward = 8Ψ_mm + 16·L·T·d, what the hardware does (PaLM's "HFU"). MFU here
    always divides the FLOPs actually performed, so checkpointing does not look like a loss of
    efficiency.
Achieved FLOP/s = FLOPs per token × tokens per second (all ranks). Peak = the sum over ranks of a
square matmul's FLOP/s measured on every rank *at the same time* and at the run's dtype (shared
cores share their speed; ~175 GFLOP/s fp32 and ~1.2 TFLOP/s bf16 per core on this machine kind). MFU
= achieved / peak, between 0 and 1: a small model on gloo spends most of a step outside matmuls.
"""

from __future__ import annotations

import time

import torch

from minizero import comm
from minizero.lab.data import sequence_length
from minizero.lab.model import GPTConfig
from minizero.optim import DTYPES

GEMM_SIZE = 1024          # [1024 x 1024] @ [1024 x 1024]: 2.1 GFLOP, ~12 ms fp32 on one core
# On a GPU a 1024 product takes microseconds, about what launching it and synchronising take, so
# the clock would time the launches: 8192 (1.1 TFLOP, ~1-2 ms bf16 on a datacenter GPU; < 1 GB of
# operands) keeps that overhead near 1 %.
CUDA_GEMM_SIZE = 8192
PEAK_SECONDS = 0.3        # how long each rank multiplies (after one warm-up product)


def matmul_params(cfg: GPTConfig) -> int:
    """Ψ_mm: weights that multiply an activation in the GPT's forward (see the top)."""
    d = cfg.n_embd
    return cfg.n_layer * (4 + 2 * cfg.mlp_ratio) * d * d + cfg.vocab_size * d


def flops_per_token(cfg: GPTConfig, checkpointing: bool | str = False) -> int:
    """Training FLOPs per token: 6Ψ_mm + 12·L·T·d, or 8Ψ_mm + 16·L·T·d with activation
    checkpointing."""
    attention = 4 * cfg.n_layer * sequence_length(cfg.block_size) * cfg.n_embd
    forward = 2 * matmul_params(cfg) + attention
    return (4 if checkpointing else 3) * forward


def gemm_size(device: torch.device) -> int:
    """The side of the square products gemm_flops_per_s times on `device`."""
    return CUDA_GEMM_SIZE if device.type == "cuda" else GEMM_SIZE


def gemm_flops_per_s(dtype: str = "fp32", device: torch.device | None = None,
                     size: int | None = None, seconds: float = PEAK_SECONDS) -> float:
    """This process's matmul FLOP/s at `dtype`: square products (gemm_size) repeated for about
    `seconds`. On CUDA every product is waited for before the clock is read: kernels run
    asynchronously, and an unsynchronised clock times only their launches."""
    device = device or comm.device()
    size = size or gemm_size(device)
    a = torch.randn(size, size, device=device).to(DTYPES[dtype])
    b = torch.randn(size, size, device=device).to(DTYPES[dtype])
    a @ b                                                        # warm-up (kernel choice, caches)
    if device.type == "cuda":          # ... finished before the clock starts, not timed with it
        torch.cuda.synchronize()
    done, start = 0, time.perf_counter()
    while True:
        a @ b
        done += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return done * 2 * size ** 3 / elapsed


def peak_worker(dtype: str = "fp32") -> float:
    """Worker: every rank multiplies at once; each returns its own FLOP/s (the peak is their
    sum)."""
    comm.barrier()
    return gemm_flops_per_s(dtype)


def peaks_worker(dtypes: list[str], threads: int | None) -> dict[str, float]:
    """Worker of --peak: this rank's GEMM FLOP/s at each dtype, every rank multiplying at once."""
    if threads:
        torch.set_num_threads(threads)
    return {dtype: peak_worker(dtype) for dtype in dtypes}


def throughput(cfg_model: GPTConfig, batch_size: int, step_time_s: float, world_size: int,
               peak_flops_per_s: float | None, checkpointing: bool | str = False) -> dict:
    """The run's throughput line: tokens/s (all ranks and per rank), achieved FLOP/s, and MFU
    against peak_flops_per_s (None: not measured, MFU None)."""
    tokens_per_s = batch_size * sequence_length(cfg_model.block_size) / step_time_s   # all ranks
    per_token = flops_per_token(cfg_model, checkpointing)
    flops_per_s = tokens_per_s * per_token
    return {"tokens_per_s": tokens_per_s, "tokens_per_s_per_rank": tokens_per_s / world_size,
            "flops_per_token": per_token, "flops_per_s": flops_per_s,
            "peak_flops_per_s": peak_flops_per_s,
            "mfu": None if not peak_flops_per_s else flops_per_s / peak_flops_per_s}


def format_throughput(t: dict) -> str:
    line = (f"throughput {t['tokens_per_s']:,.0f} tokens/s "
            f"({t['tokens_per_s_per_rank']:,.0f} per rank), {t['flops_per_s'] / 1e9:.2f} GFLOP/s")
    if t["mfu"] is not None:
        line += (f"; MFU {t['mfu']:.1%} of {t['peak_flops_per_s'] / 1e9:,.0f} GFLOP/s "
                 "(GEMM peak, all ranks)")
    return line
