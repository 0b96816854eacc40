"""Model-state memory per rank: what the ZeRO paper predicts (`estimate`) and what a rank holds (`measure`).

    python -m minizero.memory --params 7.5e9 --world-size 64     # the paper's table for any model
    python -m minizero.memory --model default --world-size 4      # the same for minizero's small GPT

The paper (ZeRO, Rajbhandari et al. 2020, section 3 and figure 1) counts *model states* only: for Ψ
parameters trained with mixed-precision Adam, 2Ψ bytes of fp16 parameters, 2Ψ of fp16 gradients and KΨ
of optimizer state, K = 12 (fp32 master weights 4 + momentum 4 + variance 4). Sharding each over N ranks:

    stage 0 (DDP)      (2 + 2 + K) Ψ               everything replicated
    stage 1  P_os      2Ψ + 2Ψ + KΨ/N              optimizer states sharded
    stage 2  P_os+g    2Ψ + (2 + K)Ψ/N             + gradients sharded
    stage 3  P_os+g+p  (2 + 2 + K)Ψ/N              + parameters sharded

param_bytes / grad_bytes generalise the 2s: pure fp32 training has 4 + 4 and Adam's K = 8 (no master copy,
the fp32 parameters are the master). Activations, buffers and temporary buffers are not model states.
"""

from __future__ import annotations

import sys
from typing import Iterable

import torch

from minizero.cli import OneLineParser, UsageError, fail

STAGES = (0, 1, 2, 3)
CATEGORIES = ("params", "grads", "optimizer", "offloaded")


def estimate_breakdown(num_params: int, world_size: int, stage: int, *, param_bytes: int = 2,
                       grad_bytes: int = 2, k: int = 12, offload: bool | str = False) -> dict[str, float]:
    """Per-rank bytes by category, as the paper counts them.

    offload=True (or "optimizer"): the KΨ/N optimizer states live in host memory (ZeRO-Offload), plus a
    fp32 host copy of the gradient partition to step on. offload="params" (stage 3): the parameter shard
    lives on the host between uses as well (ZeRO-Infinity's parameter offload).
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    psi, n = float(num_params), world_size
    params = param_bytes * psi / (n if stage >= 3 else 1)
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
             k: int = 12, offload: bool | str = False) -> float:
    """Per-rank model-state bytes on the compute device for ZeRO `stage` (0 = DDP); see module docstring."""
    b = estimate_breakdown(num_params, world_size, stage, param_bytes=param_bytes, grad_bytes=grad_bytes,
                           k=k, offload=offload)
    return b["params"] + b["grads"] + b["optimizer"]


def comm_volume(num_params: int, world_size: int, stage: int, *, bytes_per_elem: int = 2) -> float:
    """Bytes one rank sends per step in a ring (paper section 7): 2Ψ for stages 0-2, 3Ψ for stage 3,
    each times (N-1)/N, which the paper rounds to 1."""
    factor = 3 if stage == 3 else 2
    return factor * (world_size - 1) / world_size * num_params * bytes_per_elem


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


# --------------------------------------------------------------------------------------------------------
# CLI: python -m minizero.memory --params 7.5e9 --world-size 64
# --------------------------------------------------------------------------------------------------------

def _table(num_params: int, world_size: int, param_bytes: int, grad_bytes: int, k: int) -> str:
    names = {0: "DDP (baseline)", 1: "stage 1  P_os", 2: "stage 2  P_os+g", 3: "stage 3  P_os+g+p"}
    rows = [f"Ψ = {num_params:,} parameters, N = {world_size}, bytes/param: params {param_bytes}, "
            f"grads {grad_bytes}, optimizer K = {k}", "",
            f"{'':20}{'params GB':>11}{'grads GB':>11}{'optim GB':>11}{'total GB':>11}{'vs DDP':>9}"]
    base = estimate(num_params, world_size, 0, param_bytes=param_bytes, grad_bytes=grad_bytes, k=k)
    for s in STAGES:
        b = estimate_breakdown(num_params, world_size, s, param_bytes=param_bytes, grad_bytes=grad_bytes, k=k)
        total = b["params"] + b["grads"] + b["optimizer"]
        rows.append(f"{names[s]:20}{b['params'] / 1e9:11.2f}{b['grads'] / 1e9:11.2f}"
                    f"{b['optimizer'] / 1e9:11.2f}{total / 1e9:11.2f}{base / total:8.1f}x")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m minizero.memory",
                       description="Per-rank model-state memory for each ZeRO stage.")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="number of parameters Ψ, e.g. 7.5e9")
    what.add_argument("--model", choices=["default", "tiny"], help="a built-in model's real parameter count")
    ap.add_argument("--world-size", type=int, required=True, help="data-parallel ranks N")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="bf16: 2+2 bytes, K=12 (paper); fp32: 4+4 bytes, K=8")
    try:
        args = ap.parse_args(argv)
        if args.world_size < 1:
            raise UsageError("--world-size must be >= 1")
        if args.params is not None and not args.params >= 1:
            raise UsageError("--params must be >= 1")
    except UsageError as e:
        return fail(ap.prog, str(e))
    if args.params is not None:
        psi = int(args.params)
    else:
        from minizero.model import GPT, GPTConfig
        psi = GPT(GPTConfig.named(args.model)).num_params()
    pb, gb, k = (2, 2, 12) if args.dtype == "bf16" else (4, 4, 8)
    print(_table(psi, args.world_size, pb, gb, k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
