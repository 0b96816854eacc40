"""ZeRO on a 2-D mesh: N = N_m x N_d ranks, tensor parallelism (M = N_m) inside a row, ZeRO's data
parallelism (N_d) along a column. The paper's formulas with M, its Table 1, and what tensor
parallelism sends.

    python -m minizero.memory --table1                        # the paper's Table 1 (32 GB V100s)
    python -m minizero.memory --table1 --measure              # ... at small scale, measured
    python -m minizero.memory --params 7.5e9 --world-size 64 --tensor-parallel 8

Tensor parallelism (minizero/beyond/tensor_parallel.py) splits each block's weights over M ranks, so
each rank's model is Ψ/M (plus what stays replicated: LayerNorms, position embeddings, the biases of
row-parallel layers: `params_per_rank` counts those exactly). ZeRO then shards that model over the
N_d ranks of its column, so every formula of minizero/memory/__init__.py holds with Ψ/M for Ψ and
N_d for N; at stage 3, (2 + 2 + K)Ψ/(N_m·N_d). What each rank sends for it is activations, not
model states: per block and step, g's two all-reduces of the block's output [b, s, h] forward and
f's two of the input gradient backward (two more forward all-reduces when checkpointing recomputes
the block), where ZeRO sends parameters and gradients (2Ψ or 3Ψ a step).
"""

from __future__ import annotations

from minizero.comm import ring_bytes
from minizero.memory import estimate

# The paper's Table 1: model-parallel degrees on 64-way data parallelism, 32 GB V100s, mixed
# precision Adam (K = 12).
TABLE1_MODEL_PARALLEL = (1, 2, 4, 8, 16)
TABLE1_DATA_PARALLEL = 64
TABLE1_DEVICE_BYTES = 32e9


def params_per_rank(split: int, replicated: int, tensor_parallel: int) -> int:
    """Ψ on one rank of a tensor-parallel group: 1/M of the split weights, all of the rest."""
    if split % tensor_parallel:
        raise ValueError(f"{split} split parameters do not divide over {tensor_parallel} ranks")
    return split // tensor_parallel + replicated


def estimate_mesh(num_params: float, tensor_parallel: int, data_parallel: int, stage: int,
                  **sizes) -> float:
    """Per-rank model-state bytes with every parameter split M ways (the paper's count) and ZeRO
    `stage` over the N_d data-parallel ranks; sizes as `estimate` takes them."""
    return estimate(num_params / tensor_parallel, data_parallel, stage, **sizes)


def largest_model(device_bytes: float, tensor_parallel: int, data_parallel: int, stage: int,
                  **sizes) -> float:
    """The most parameters whose model states fit `device_bytes` per rank: the formulas are linear
    in Ψ, so Ψ_max = device_bytes / (bytes per parameter per rank)."""
    return device_bytes / estimate_mesh(1.0, tensor_parallel, data_parallel, stage, **sizes)


def table1(device_bytes: float = TABLE1_DEVICE_BYTES,
           data_parallel: int = TABLE1_DATA_PARALLEL) -> list[dict]:
    """The paper's Table 1: for each model-parallel degree M, the largest model each stage fits."""
    return [{"model_parallel": m, "gpus": m * data_parallel,
             "largest": [largest_model(device_bytes, m, data_parallel, s) for s in range(4)]}
            for m in TABLE1_MODEL_PARALLEL]


def tensor_parallel_bytes(batch: int, seq: int, hidden: int, tensor_parallel: int, *, layers: int,
                          bytes_per_elem: int = 4, recompute: bool = False) -> float:
    """Bytes one rank sends per step for tensor parallelism over `layers` blocks (ring all-reduces
    of [b, s, h] in the group of M): 4 a block (f and g, twice), 6 when checkpointing recomputes."""
    per_block = 6 if recompute else 4
    activation = bytes_per_elem * batch * seq * hidden
    return layers * per_block * ring_bytes("all_reduce", activation, tensor_parallel)


def gpt_tensor_parallel_bytes(batch: int, seq: int, hidden: int, tensor_parallel: int, *,
                              layers: int, bytes_per_elem: int = 4,
                              recompute: bool = False) -> float:
    """The same for minizero's split GPT (tensor_parallel.parallelize_gpt), one micro-batch: its
    blocks, the vocab-parallel embedding's g and the tied head's f ([b, s, h] each), and the loss's
    three all-reduces of b·s fp32 numbers (cross_entropy)."""
    edges = 2 * ring_bytes("all_reduce", bytes_per_elem * batch * seq * hidden, tensor_parallel)
    loss = 3 * ring_bytes("all_reduce", 4 * batch * seq, tensor_parallel)
    return tensor_parallel_bytes(batch, seq, hidden, tensor_parallel, layers=layers,
                                 bytes_per_elem=bytes_per_elem, recompute=recompute) + edges + loss
