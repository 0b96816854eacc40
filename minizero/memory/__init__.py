"""Memory per rank: what the ZeRO paper predicts (`estimate`, `activation_bytes`) and what a rank
holds (`measure`).

    python -m minizero.memory --params 7.5e9 --world-size 64     # the paper's table for any model
    python -m minizero.memory --model default --world-size 4     # the same for minizero's small GPT
    python -m minizero.memory --layers 48 --hidden 1600 --seq 1024 --batch 32 --heads 25 \
        --world-size 64

The paper (ZeRO, Rajbhandari et al. 2020, section 3 and figure 1) counts *model states* only: for Ψ
parameters trained with mixed-precision Adam, 2Ψ bytes of fp16 parameters, 2Ψ of fp16 gradients and
KΨ of optimizer state, K = 12 (fp32 master weights 4 + momentum 4 + variance 4). Sharding each over
N ranks:

    stage 0 (DDP)      (2 + 2 + K) Ψ               everything replicated
    stage 1  P_os      2Ψ + 2Ψ + KΨ/N              optimizer states sharded
    stage 2  P_os+g    2Ψ + (2 + K)Ψ/N             + gradients sharded
    stage 3  P_os+g+p  (2 + 2 + K)Ψ/N              + parameters sharded

param_bytes / grad_bytes generalise the 2s: pure fp32 training has 4 + 4 and Adam's K = 8 (no master
copy, the fp32 parameters are the master); bf16/fp16 with reduce_dtype="fp32" (flat.py) keeps its
gradients in fp32: 2 + 4 + K (`grad_bytes`). Activations, buffers and temporary buffers are not
model states: ZeRO-R (section 6) is about them, and `activation_bytes` estimates the activations of
minizero's GPT.

Beyond the paper, shard_group_size=S (HSDP / MiCS, [Note: hierarchical sharding] in
beyond/hierarchical.py): S replaces N in every sharded term (stage 3: (2 + 2 + K)Ψ/S), and a step
sends, as the ring tally counts it, a reduce-scatter (S-1)/S·Ψ in the shard group, an
all-reduce 2(N/S-1)/(N/S)·Ψ/S of this rank's partition across the N/S groups, and the
all-gathers (S-1)/S·Ψ each (`step_collectives`). ZeRO++'s hpZ (hpz_group_size=R, zero3.py):
backward's all-gather runs in a node's group of R ranks, (R-1)/R·Ψ, so the bytes crossing nodes
fall from 3Ψ to 2Ψ (`comm_volume_by_node`), for Ψ/R more parameter memory between forward and
backward (`secondary_partition_bytes`).

Measured bytes equal these formulas up to padding (flat.py pads each bucket to a multiple of N):
`within_padding` is the one statement of how far that can be.
"""

from __future__ import annotations

from typing import Iterable

import torch

from minizero.beyond import quantize
from minizero.beyond.mesh import column_of, row_of
from minizero.beyond.network import ranks_span_nodes
from minizero.comm import ring_bytes
from minizero.optim import DTYPES
from minizero.options import check_stage

CATEGORIES = ("params", "grads", "optimizer", "offloaded")   # in memory; estimates add "disk"


def element_bytes(dtype: str) -> int:
    """Bytes of one parameter (and one gradient) in the compute dtype: fp32 4, bf16 and fp16 2 (the
    paper's 2)."""
    return DTYPES[dtype].itemsize


def grad_bytes(dtype: str, reduce_dtype: str | None = None) -> int:
    """Bytes of one gradient: the dtype gradients are reduced and accumulated in (reduce_dtype,
    default the compute dtype). bf16 + reduce_dtype="fp32": 4, the paper's 2 doubled."""
    return element_bytes(reduce_dtype or dtype)


def optimizer_k(state_bytes: int, dtype: str, offload: bool | str = False) -> int:
    """K of the paper for a run: the optimizer's own state per parameter (Adam: two fp32 moments,
    8; SGD with momentum 4; plain SGD 0) plus the fp32 master copy, which exists when the model
    computes in lower precision (optim.py) or when the optimizer is offloaded to the host
    (offload.py keeps a host master; the disk tier, beyond/disk.py, steps fp32 parameters in place,
    as in memory)."""
    master = 4 if (dtype != "fp32" or offload not in (False, "disk")) else 0
    return state_bytes + master


def within_padding(measured: float, formula: float, world_size: int, times: int = 1,
                   blocks: int = 0) -> bool:
    """Whether a measured byte count equals the paper's formula up to padding, the one difference
    the formulas leave out: each bucket is padded by fewer than N elements (flat.padded_size), and
    no category holds more than 16 bytes per element (fp32 + Adam: 4 + 4 + 8; bf16: 2 + 2 + 12);
    counted generously for 8 buckets. `times`: a count that touches every padded bucket several
    times (stage 3 sends each unit three times a step). `blocks`: records padded to a whole disk
    block each (the disk tier's pieces, disk.ALIGN = 4096 bytes: direct I/O moves whole blocks)."""
    return formula - 1e-6 <= measured <= formula + times * 8 * world_size * 16 + blocks * 4096


def _partitions(world_size: int, stage: int, shard_group_size: int | None) -> int:
    """How many ranks share a partitioned term: N, or S with shard_group_size (stages 1-3)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    if shard_group_size is None:
        return world_size
    if stage == 0 or shard_group_size < 1 or world_size % shard_group_size:
        raise ValueError(
            f"shard_group_size needs stage 1-3 and must divide the world size {world_size}, "
            f"got {shard_group_size!r} at stage {stage}"
        )
    return shard_group_size


def estimate_breakdown(num_params: int, world_size: int, stage: int, *, param_bytes: int = 2,
                       grad_bytes: int = 2, k: int = 12, offload: bool | str = False,
                       frozen: int = 0, shard_group_size: int | None = None) -> dict[str, float]:
    """Per-rank bytes by category, as the paper counts them, for Ψ = num_params
    trainable parameters.

    frozen=Ψ_f: parameters that are never trained (a fine-tuned model's base, LoRA's frozen
    weights). They have no gradient and no optimizer state, but they are parameters: replicated in
    stages 0-2 (as in the paper and DeepSpeed), partitioned like the rest in stage 3, so
    parameters take
    (Ψ + Ψ_f)·param_bytes, divided by N in stage 3.

    offload=True (or "optimizer"): the KΨ/N optimizer states live in host memory (ZeRO-Offload),
    plus a fp32 host copy of the gradient partition to step on. offload="params" (stage 3): the
    parameter shard lives on the host between uses as well (ZeRO-Infinity's parameter offload).
    offload="disk" (ZeRO-Infinity's disk tier, beyond/disk.py): the KΨ/N live in a file ("disk"),
    read and written
    once a step (disk_traffic); memory holds only the pipeline's three pieces, during the step.

    shard_group_size=S: partitioned over S ranks, replicated over N/S groups: S in place of N.
    """
    check_stage(stage)
    psi, n = float(num_params), _partitions(world_size, stage, shard_group_size)
    params = param_bytes * (psi + frozen) / (n if stage >= 3 else 1)
    grads = grad_bytes * psi / (n if stage >= 2 else 1)
    optimizer = k * psi / (n if stage >= 1 else 1)
    offloaded = disk = 0.0
    if offload == "disk":
        disk, optimizer = optimizer, 0.0
    elif offload:
        # states + fp32 gradient partition
        offloaded = optimizer + 4 * psi / (n if stage >= 1 else 1)
        optimizer = 0.0
        if offload == "params":
            offloaded += params
            params = 0.0
    return {"params": params, "grads": grads, "optimizer": optimizer, "offloaded": offloaded,
            "disk": disk}


def disk_traffic(num_params: int, world_size: int, *, k: int = 12,
                 shard_group_size: int | None = None) -> dict[str, float]:
    """Bytes one rank's disk tier reads and writes per step (beyond/disk.py): every byte of its KΨ/N
    of state, once each way. A disk of read and write bandwidths B_r, B_w shared by the machine's
    ranks needs at least the sum over them of KΨ/N · (1/B_r + 1/B_w) a step: the step's floor."""
    state = k * float(num_params) / _partitions(world_size, 1, shard_group_size)
    return {"read": state, "written": state}


def estimate(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    k: int = 12,
    offload: bool | str = False,
    frozen: int = 0,
    shard_group_size: int | None = None,
) -> float:
    """Per-rank model-state bytes on the compute device for ZeRO `stage` (0 = DDP); see module
    docstring and estimate_breakdown (frozen=Ψ_f, shard_group_size=S)."""
    b = estimate_breakdown(
        num_params,
        world_size,
        stage,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        k=k,
        offload=offload,
        frozen=frozen,
        shard_group_size=shard_group_size,
    )
    return b["params"] + b["grads"] + b["optimizer"]


def secondary_partition_bytes(num_params: int, hpz_group_size: int, *, param_bytes: int = 2,
                              frozen: int = 0) -> float:
    """hpZ's price per rank: the secondary partition, param_bytes·(Ψ + Ψ_f)/R ([Note: hpZ] in
    beyond/hpz.py). Not a model state between steps (estimate): it lives from each unit's forward
    to its backward, so it raises the parameter peak at the start of backward
    (memory()["peak_params"]) by this much."""
    return param_bytes * (num_params + frozen) / hpz_group_size


def step_collectives(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    bytes_per_elem: int = 2,
    grad_bytes: int | None = None,
    frozen: int = 0,
    shard_group_size: int | None = None,
    hpz_group_size: int | None = None,
    quantized_weights: bool = False,
    quantized_gradients: bool = False,
    block: int = quantize.BLOCK,
) -> list[dict]:
    """The collectives of one step as the ring tally (comm.ring_bytes) counts them, one dict each:
    "kind", "group" ("world", "shard": a row of S consecutive ranks, "replicate": a column, one rank
    of each shard group, "hpz": a row of R ranks), "ranks" (its size) and "bytes" one rank sends.

        stage 0      all-reduce of the gradients over N                         2(N-1)/N·Ψ
        stages 1-3   reduce-scatter of the gradients in the shard group          (S-1)/S·Ψ
                     with S < N: all-reduce of the partition across groups      2(N/S-1)/(N/S)·Ψ/S
        stages 1-2   all-gather of the updated parameters in the shard group     (S-1)/S·Ψ
        stage 3      forward all-gather (S-1)/S·(Ψ + Ψ_f), backward all-gather the same, or with hpZ
                     within the node: (R-1)/R·(Ψ + Ψ_f)
    S = N is the paper's (section 7): 2Ψ, 3Ψ times (N-1)/N. With S < N a step of stages 1-2 still
    sends 2(N-1)/N·Ψ in all, (S-1)/S·Ψ twice within the group plus 2(N/S-1)/N·Ψ across groups: the
    same bytes, of which only the last leave the shard group. Gradients travel at grad_bytes each
    (default bytes_per_elem; 4 with reduce_dtype="fp32"), parameters at bytes_per_elem. Frozen
    parameters (Ψ_f) are never reduced.

    ZeRO++ (beyond/quantize.py), int8 in blocks of `block`: quantized_gradients (stages 2-3) turns
    the reduce-scatter into an all-to-all of Ψ + 4Ψ/B bytes (quantize.wire_bytes) instead of
    Ψ·grad_bytes; quantized_weights (stage 3) sends forward's all-gather of Ψ + Ψ_f the same way:
    3Ψ·2 = 6Ψ bytes of bf16 stage 3 become Ψ(1 + 4/B) + 2Ψ + Ψ(1 + 4/B), about 4Ψ. Exact when B
    divides each rank's chunk of every bucket."""
    n, psi = world_size, num_params
    s = _partitions(world_size, stage, shard_group_size)
    g, p = (bytes_per_elem if grad_bytes is None else grad_bytes), bytes_per_elem
    rows = []

    def add(kind, group, ranks, full_bytes):
        rows.append(
            {
                "kind": kind,
                "group": group,
                "ranks": ranks,
                "bytes": ring_bytes(kind, full_bytes, ranks),
            }
        )
    if stage == 0:
        add("all_reduce", "world", n, psi * g)
        return rows
    if quantized_gradients:
        add("all_to_all", "shard", s, quantize.wire_bytes(psi, block))
    else:
        add("reduce_scatter", "shard", s, psi * g)
    if s < n:
        add("all_reduce", "replicate", n // s, psi / s * g)
    if stage < 3:
        add("all_gather", "shard", s, psi * p)
        return rows
    if quantized_weights:
        add(
            "all_gather",
            "shard",
            s,
            quantize.wire_bytes(psi, block) + quantize.wire_bytes(frozen, block),
        )
    else:
        add("all_gather", "shard", s, (psi + frozen) * p)                             # forward
    if hpz_group_size is None:
        add("all_gather", "shard", s, (psi + frozen) * p)                             # backward
    else:
        add("all_gather", "hpz", hpz_group_size, (psi + frozen) * p)         # backward, in the node
    return rows


def comm_volume(num_params: int, world_size: int, stage: int, *, bytes_per_elem: int = 2,
                **options) -> float:
    """Bytes one rank sends per step in a ring (paper section 7): 2Ψ for stages 0-2, 3Ψ for stage 3,
    each times (N-1)/N, which the paper rounds to 1: the sum of step_collectives (its options:
    grad_bytes, frozen, shard groups, hpZ, ZeRO++'s quantization). Frozen parameters (Ψ_f) are never
    reduced; stage 3 gathers them for forward and backward: + 2Ψ_f."""
    return sum(row["bytes"] for row in step_collectives(num_params, world_size, stage,
                                                         bytes_per_elem=bytes_per_elem, **options))


def comm_volume_by_kind(
    num_params: int, world_size: int, stage: int, **options
) -> dict[str, float]:
    """comm_volume per kind of collective (the keys of comm.tally()); options as
    step_collectives'."""
    out: dict[str, float] = {}
    for row in step_collectives(num_params, world_size, stage, **options):
        out[row["kind"]] = out.get(row["kind"], 0.0) + row["bytes"]
    return out


def group_ranks(group: str, rank: int, world_size: int, shard_group_size: int | None = None,
                hpz_group_size: int | None = None) -> list[int]:
    """The global ranks of `rank`'s group of a step_collectives kind (beyond/mesh.py's rows
    and columns)."""
    n = world_size
    s = n if shard_group_size is None else shard_group_size
    if group == "world":
        return list(range(n))
    if group == "shard":
        return row_of(rank, s)
    if group == "replicate":
        return column_of(rank, s, n)
    return row_of(rank, hpz_group_size)


def comm_volume_by_node(
    num_params: int, world_size: int, stage: int, ranks_per_node: int, *, rank: int = 0, **options
) -> dict[str, float]:
    """comm_volume split as comm.tally()'s "intra_node" / "inter_node" (the network model's rule): a
    collective whose group lies inside one node of ranks_per_node consecutive ranks is intra-node,
    one whose group spans nodes is inter-node. Stage 3 with hpz_group_size = ranks_per_node:
    inter-node bytes fall from 3(N-1)/N·Ψ to 2(N-1)/N·Ψ (forward all-gather + reduce-scatter); the
    backward all-gather, (R-1)/R·Ψ, stays in the node."""
    out = {"intra_node": 0.0, "inter_node": 0.0}
    for row in step_collectives(num_params, world_size, stage, **options):
        ranks = group_ranks(row["group"], rank, world_size, options.get("shard_group_size"),
                            options.get("hpz_group_size"))
        out["inter_node" if ranks_span_nodes(ranks, ranks_per_node) else "intra_node"] += row[
            "bytes"
        ]
    return out


def measure(groups: dict[str, Iterable[torch.Tensor]]) -> dict[str, int]:
    """Bytes resident in each category, counting each storage once (a view counts as its whole
    storage, and a storage already seen in an earlier category is not counted again: a fp32 master
    that *is* the parameter buffer counts as parameters, not twice)."""
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


def activation_bytes(
    layers: int,
    hidden: int,
    heads: int,
    seq: int,
    batch: int,
    *,
    bytes_per_elem: int = 4,
    mlp_ratio: int = 4,
    checkpointing: bool | str = False,
    tensor_parallel: int = 1,
) -> float:
    """Peak bytes saved for backward by one forward of minizero's GPT (lab/model.py) on a
    micro-batch of `batch` rows of `seq` tokens: what engine.memory()["activations"]
    measures (beyond/activations.py).

    Per block, with s = seq, b = batch, h = hidden, a = heads, r = mlp_ratio, e = bytes_per_elem:
        e·s·b·((8 + 2r)·h + a·s + 4) + s²
    (8 + 2r)·h: the inputs of ln1, qkv, proj, ln2 and the MLP's first Linear; q, k and v (matmul
    keeps contiguous copies); the GELU's input and the second Linear's input, r·h each. a·s: the
    softmax's output (the attention scores, a·s² per row). 4: the two LayerNorms' mean and 1/std.
    s²: the causal mask (bool, shared by the batch). Parameters are not activations (model states
    count them). Korthikanti et al. 2022 count s·b·h·(34 + 5·a·s/h) bytes for the same block in fp16
    with dropout: their 34 has the dropout masks and 2-byte elements, their 5·a·s/h the scores and
    their dropout; the ZeRO paper's rough figure is 12·h·b·s per layer. Outside the blocks: ln_f's
    input and statistics, the head's input, e·s·b·(2h + 2), and the token ids and positions (int64),
    8·(s·b + s). The loss is the caller's.

    checkpointing=True (beyond/activations.py) keeps each block's input, e·s·b·h, and holds one
    block's activations again while backward recomputes it; the peak is the larger of the end of
    forward (all inputs + what is outside the blocks) and the last block's recompute (all inputs +
    that block + the ids). "cpu" keeps the inputs in host memory: the device holds the larger of the
    two without them.

    tensor_parallel=M (one rank of a tensor-parallel row, minizero/beyond/tensor_parallel.py): of
    the (8 + 2r)·h, what the column-parallel layers produce and the row-parallel ones take is split,
    q, k, v, the attention's output and the MLP's two r·h, (4 + 2r)·h/M; the scores a·s/M (a/M
    heads); the LayerNorms' inputs and the column-parallel layers' input, 4h, stay whole on every
    rank (the replica P_a partitions). The vocab-parallel embedding adds its mask, s·b bytes.
    "partitioned" (P_a) keeps 1/M of each block's input, and its recompute holds the all-gathered
    input as a new tensor; "partitioned+cpu" keeps that 1/M on the host.
    """
    s, b, h, e, m = seq, batch, hidden, bytes_per_elem, tensor_parallel
    split = (4 + 2 * mlp_ratio) * h // m + heads * s // m
    block = e * s * b * (4 * h + split + 4) + s * s
    ids = 8 * (s * b + s) + (s * b if m > 1 else 0)
    outside = e * s * b * (2 * h + 2) + ids
    if not checkpointing:
        return layers * block + outside
    on_host = checkpointing in ("cpu", "partitioned+cpu")
    share = m if checkpointing == "partitioned" else 1                     # P_a: 1/M of each input
    inputs = 0 if on_host else layers * e * s * b * h // share
    # with True the recomputed block's input is that checkpoint (counted in `inputs` already)
    recompute = block + ids - (e * s * b * h if checkpointing is True else 0)
    return inputs + max(outside, recompute)
