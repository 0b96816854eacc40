"""Memory per rank: what the ZeRO paper predicts (`estimate`, `activation_bytes`) and what a rank holds (`measure`).

    python -m minizero.memory --params 7.5e9 --world-size 64     # the paper's table for any model
    python -m minizero.memory --model default --world-size 4      # the same for minizero's small GPT
    python -m minizero.memory --layers 48 --hidden 1600 --seq 1024 --batch 32 --heads 25 --world-size 64

The paper (ZeRO, Rajbhandari et al. 2020, section 3 and figure 1) counts *model states* only: for Ψ
parameters trained with mixed-precision Adam, 2Ψ bytes of fp16 parameters, 2Ψ of fp16 gradients and KΨ
of optimizer state, K = 12 (fp32 master weights 4 + momentum 4 + variance 4). Sharding each over N ranks:

    stage 0 (DDP)      (2 + 2 + K) Ψ               everything replicated
    stage 1  P_os      2Ψ + 2Ψ + KΨ/N              optimizer states sharded
    stage 2  P_os+g    2Ψ + (2 + K)Ψ/N             + gradients sharded
    stage 3  P_os+g+p  (2 + 2 + K)Ψ/N              + parameters sharded

param_bytes / grad_bytes generalise the 2s: pure fp32 training has 4 + 4 and Adam's K = 8 (no master copy,
the fp32 parameters are the master); bf16/fp16 with reduce_dtype="fp32" (engine.py) keeps its gradients in
fp32: 2 + 4 + K (`grad_bytes`). Activations, buffers and temporary buffers are not model states:
ZeRO-R (section 6) is about them, and `activation_bytes` estimates the activations of minizero's GPT.

Measured bytes equal these formulas up to padding (flat.py pads each bucket to a multiple of N):
`within_padding` is the one statement of how far that can be.
"""

from __future__ import annotations

from typing import Iterable

import torch

from minizero import quantize
from minizero.optim import DTYPES

STAGES = (0, 1, 2, 3)                      # 0 = DDP; minizero.wrap has one engine per stage
CATEGORIES = ("params", "grads", "optimizer", "offloaded")


def element_bytes(dtype: str) -> int:
    """Bytes of one parameter (and one gradient) in the compute dtype: fp32 4, bf16 and fp16 2 (the paper's 2)."""
    return DTYPES[dtype].itemsize


def grad_bytes(dtype: str, reduce_dtype: str | None = None) -> int:
    """Bytes of one gradient: the dtype gradients are reduced and accumulated in (reduce_dtype, default
    the compute dtype). bf16 + reduce_dtype="fp32": 4, the paper's 2 doubled."""
    return element_bytes(reduce_dtype or dtype)


def optimizer_k(state_bytes: int, dtype: str, offload: bool | str = False) -> int:
    """K of the paper for a run: the optimizer's own state per parameter (Adam: two fp32 moments, 8; SGD
    with momentum 4; plain SGD 0) plus the fp32 master copy, which exists when the model computes in
    lower precision (optim.py) or when the optimizer is offloaded (offload.py keeps a host master)."""
    master = 4 if (dtype != "fp32" or offload) else 0
    return state_bytes + master


def within_padding(measured: float, formula: float, world_size: int, times: int = 1) -> bool:
    """Whether a measured byte count equals the paper's formula up to padding, the one difference the
    formulas leave out: each bucket is padded by fewer than N elements (flat.padded_size), and no category
    holds more than 16 bytes per element (fp32 + Adam: 4 + 4 + 8; bf16: 2 + 2 + 12); counted generously
    for 8 buckets. `times`: a count that touches every padded bucket several times (stage 3 sends each
    unit three times a step)."""
    return formula - 1e-6 <= measured <= formula + times * 8 * world_size * 16


def estimate_breakdown(num_params: int, world_size: int, stage: int, *, param_bytes: int = 2,
                       grad_bytes: int = 2, k: int = 12, offload: bool | str = False,
                       frozen: int = 0) -> dict[str, float]:
    """Per-rank bytes by category, as the paper counts them, for Ψ = num_params trainable parameters.

    frozen=Ψ_f: parameters that are never trained (a fine-tuned model's base, LoRA's frozen weights).
    They have no gradient and no optimizer state, but they are parameters: replicated in stages 0-2 (as
    in the paper and DeepSpeed), partitioned like the rest in stage 3, so parameters take
    (Ψ + Ψ_f)·param_bytes, divided by N in stage 3.

    offload=True (or "optimizer"): the KΨ/N optimizer states live in host memory (ZeRO-Offload), plus a
    fp32 host copy of the gradient partition to step on. offload="params" (stage 3): the parameter shard
    lives on the host between uses as well (ZeRO-Infinity's parameter offload).
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(map(str, STAGES))} (0 = DDP), got {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    psi, n = float(num_params), world_size
    params = param_bytes * (psi + frozen) / (n if stage >= 3 else 1)
    grads = grad_bytes * psi / (n if stage >= 2 else 1)
    optimizer = k * psi / (n if stage >= 1 else 1)
    offloaded = 0.0
    if offload:
        offloaded = optimizer + 4 * psi / (n if stage >= 1 else 1)   # states + fp32 gradient partition
        optimizer = 0.0
        if offload == "params":
            offloaded += params
            params = 0.0
    return {"params": params, "grads": grads, "optimizer": optimizer, "offloaded": offloaded}


def estimate(num_params: int, world_size: int, stage: int, *, param_bytes: int = 2, grad_bytes: int = 2,
             k: int = 12, offload: bool | str = False, frozen: int = 0) -> float:
    """Per-rank model-state bytes on the compute device for ZeRO `stage` (0 = DDP); see module docstring
    and estimate_breakdown (frozen=Ψ_f)."""
    b = estimate_breakdown(num_params, world_size, stage, param_bytes=param_bytes, grad_bytes=grad_bytes,
                           k=k, offload=offload, frozen=frozen)
    return b["params"] + b["grads"] + b["optimizer"]


def comm_volume(num_params: int, world_size: int, stage: int, *, bytes_per_elem: int = 2,
                grad_bytes: int | None = None, frozen: int = 0, quantized_weights: bool = False,
                quantized_gradients: bool = False, block: int = quantize.BLOCK) -> float:
    """Bytes one rank sends per step in a ring (paper section 7): 2Ψ for stages 0-2, 3Ψ for stage 3,
    each times (N-1)/N, which the paper rounds to 1. Frozen parameters (Ψ_f) are never reduced; stage 3
    gathers them for forward and backward: + 2Ψ_f. Of those elements the gradients' (DDP's all-reduce,
    2Ψ; stages 1-3's reduce-scatter, Ψ) travel at grad_bytes each (default bytes_per_elem; 4 with
    reduce_dtype="fp32"), the parameters' all-gathers at bytes_per_elem.

    ZeRO++ (quantize.py), int8 in blocks of `block`: quantized_weights (stage 3) sends forward's all-gather
    of Ψ + Ψ_f as quantize.wire_bytes (Ψ + 4Ψ/B instead of Ψ·bytes_per_elem), quantized_gradients (stages
    2-3) the reduce-scatter's Ψ (an all-to-all of int8 chunks): 3Ψ·2 = 6Ψ bytes of bf16 stage 3 become
    Ψ(1 + 4/B) + 2Ψ + Ψ(1 + 4/B), about 4Ψ. Exact when B divides each rank's chunk of every bucket."""
    grads = (2 * num_params if stage == 0 else num_params) * (bytes_per_elem if grad_bytes is None else grad_bytes)
    if quantized_gradients:
        grads = quantize.wire_bytes(num_params, block)
    gathered = {0: 0, 1: num_params, 2: num_params, 3: 2 * num_params + 2 * frozen}[stage] * bytes_per_elem
    if quantized_weights:            # forward's gather of Ψ + Ψ_f, at 1 + 4/B bytes instead of bytes_per_elem
        gathered += (quantize.wire_bytes(num_params, block) + quantize.wire_bytes(frozen, block)
                     - (num_params + frozen) * bytes_per_elem)
    return (world_size - 1) / world_size * (grads + gathered)


def measure(groups: dict[str, Iterable[torch.Tensor]]) -> dict[str, int]:
    """Bytes resident in each category, counting each storage once (a view counts as its whole storage,
    and a storage already seen in an earlier category is not counted again: a fp32 master that *is* the
    parameter buffer counts as parameters, not twice)."""
    seen: set[int] = set()
    out = {}
    for name, tensors in groups.items():
        total = 0
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
        out[name] = total
    return out


def activation_bytes(layers: int, hidden: int, heads: int, seq: int, batch: int, *, bytes_per_elem: int = 4,
                     mlp_ratio: int = 4, checkpointing: bool | str = False) -> float:
    """Peak bytes saved for backward by one forward of minizero's GPT (lab/model.py) on a micro-batch of
    `batch` rows of `seq` tokens: what engine.memory()["activations"] measures (activations.py).

    Per block, with s = seq, b = batch, h = hidden, a = heads, r = mlp_ratio, e = bytes_per_elem:
        e·s·b·((8 + 2r)·h + a·s + 4) + s²
    (8 + 2r)·h: the inputs of ln1, qkv, proj, ln2 and the MLP's first Linear; q, k and v (matmul keeps
    contiguous copies); the GELU's input and the second Linear's input, r·h each. a·s: the softmax's output
    (the attention scores, a·s² per row). 4: the two LayerNorms' mean and 1/std. s²: the causal mask
    (bool, shared by the batch). Parameters are not activations (model states count them). Korthikanti et
    al. 2022 count s·b·h·(34 + 5·a·s/h) bytes for the same block in fp16 with dropout: their 34 has the
    dropout masks and 2-byte elements, their 5·a·s/h the scores and their dropout; the ZeRO paper's rough
    figure is 12·h·b·s per layer. Outside the blocks: ln_f's input and statistics, the head's input,
    e·s·b·(2h + 2), and the token ids and positions (int64), 8·(s·b + s). The loss is the caller's.

    checkpointing=True (activations.py) keeps each block's input, e·s·b·h, and holds one block's
    activations again while backward recomputes it; the peak is the larger of the end of forward (all
    inputs + what is outside the blocks) and the last block's recompute (all inputs + that block + the ids).
    "cpu" keeps the inputs in host memory: the device holds the larger of the two without them.
    """
    s, b, h, e = seq, batch, hidden, bytes_per_elem
    block = e * s * b * ((8 + 2 * mlp_ratio) * h + heads * s + 4) + s * s
    ids = 8 * (s * b + s)
    outside = e * s * b * (2 * h + 2) + ids
    if not checkpointing:
        return layers * block + outside
    inputs = layers * e * s * b * h if checkpointing != "cpu" else 0
    recompute = block + ids - (e * s * b * h if checkpointing != "cpu" else 0)   # its input is among `inputs`
    return inputs + max(outside, recompute)
