"""The command behind `python -m minizero.memory`: the paper's per-rank model-state table for a model.

    python -m minizero.memory --params 7.5e9 --world-size 64     # the paper's figure 1, any model size
    python -m minizero.memory --model default --world-size 4      # minizero's small GPT
"""

from __future__ import annotations

from minizero.cli import OneLineParser, UsageError, fail
from minizero.lab.model import GPT, MODEL_NAMES, GPTConfig
from minizero.lab.train import state_bytes
from minizero.memory import (
    STAGES,
    element_bytes,
    estimate,
    estimate_breakdown,
    optimizer_k,
)
from minizero.optim import DTYPES


def _table(num_params: int, world_size: int, param_bytes: int, grad_bytes: int, k: int, frozen: int = 0) -> str:
    names = {0: "DDP (baseline)", 1: "stage 1  P_os", 2: "stage 2  P_os+g", 3: "stage 3  P_os+g+p"}
    of_them = f" ({frozen:,} of them frozen)" if frozen else ""
    rows = [f"Ψ = {num_params + frozen:,} parameters{of_them}, N = {world_size}, bytes/param: params "
            f"{param_bytes}, grads {grad_bytes}, optimizer K = {k}", "",
            f"{'':20}{'params GB':>11}{'grads GB':>11}{'optim GB':>11}{'total GB':>11}{'vs DDP':>9}"]
    sizes = dict(param_bytes=param_bytes, grad_bytes=grad_bytes, k=k, frozen=frozen)
    base = estimate(num_params, world_size, 0, **sizes)
    for s in STAGES:
        b = estimate_breakdown(num_params, world_size, s, **sizes)
        total = b["params"] + b["grads"] + b["optimizer"]
        rows.append(f"{names[s]:20}{b['params'] / 1e9:11.2f}{b['grads'] / 1e9:11.2f}"
                    f"{b['optimizer'] / 1e9:11.2f}{total / 1e9:11.2f}{base / total:8.1f}x")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m minizero.memory",
                       description="Per-rank model-state memory for each ZeRO stage.")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="number of parameters Ψ, e.g. 7.5e9")
    what.add_argument("--model", choices=MODEL_NAMES, help="a built-in model's real parameter count")
    ap.add_argument("--world-size", type=int, required=True, help="data-parallel ranks N")
    ap.add_argument("--frozen", type=float, default=0, help="of them, parameters that are frozen (Ψ_f: no "
                    "gradient, no optimizer state; partitioned only at stage 3)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                    help="bf16, fp16: 2+2 bytes, K=12 (paper); fp32: 4+4 bytes, K=8")
    try:
        args = ap.parse_args(argv)
        if args.world_size < 1:
            raise UsageError("--world-size must be >= 1")
        if args.params is not None and not args.params >= 1:
            raise UsageError("--params must be >= 1")
        if not 0 <= args.frozen < (args.params or float("inf")):
            raise UsageError("--frozen must be >= 0 and fewer than --params")
    except UsageError as e:
        return fail(ap.prog, str(e))
    psi = int(args.params) if args.params is not None else GPT(GPTConfig.named(args.model)).num_params()
    elem = element_bytes(args.dtype)
    frozen = int(args.frozen)
    print(_table(psi - frozen, args.world_size, elem, elem, optimizer_k(state_bytes("adamw"), args.dtype), frozen))
    return 0

