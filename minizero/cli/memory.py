"""The command behind `python -m minizero.memory`: per-rank model states for each stage, and activations.

    python -m minizero.memory --params 7.5e9 --world-size 64     # the paper's figure 1, any model size
    python -m minizero.memory --model default --world-size 4      # minizero's small GPT
    python -m minizero.memory --layers 48 --hidden 1600 --heads 25 --seq 1024 --batch 32 --world-size 64
                                                                  # a GPT: + activations, with checkpointing

A GPT described by --layers/--hidden/--seq/--batch gets Ψ from its shape (lab.model.count_params, with
--vocab) and its activations per rank (memory.activation_bytes, micro-batch --batch) next to the model
states: kept for backward, and with activation checkpointing (each block's input, plus one block's
recompute), on the device or with the inputs on the host.
"""

from __future__ import annotations

from minizero.cli import OneLineParser, UsageError, fail
from minizero.lab.model import GPT, MODEL_NAMES, GPTConfig, count_params
from minizero.lab.train import state_bytes
from minizero.memory import (
    activation_bytes,
    element_bytes,
    estimate,
    estimate_breakdown,
    optimizer_k,
)
from minizero.optim import DTYPES
from minizero.options import STAGES

GPT2_VOCAB = 50257


def _table(num_params: int, world_size: int, param_bytes: int, grad_bytes: int, k: int, frozen: int = 0,
           activations: dict | None = None) -> str:
    names = {0: "DDP (baseline)", 1: "stage 1  P_os", 2: "stage 2  P_os+g", 3: "stage 3  P_os+g+p"}
    of_them = f" ({frozen:,} of them frozen)" if frozen else ""
    rows = [f"Ψ = {num_params + frozen:,} parameters{of_them}, N = {world_size}, bytes/param: params "
            f"{param_bytes}, grads {grad_bytes}, optimizer K = {k}", ""]
    header = f"{'':20}{'params GB':>11}{'grads GB':>11}{'optim GB':>11}{'total GB':>11}{'vs DDP':>9}"
    if activations:
        rows[-1:] = ["", "activations per rank, GB: " + ", ".join(f"{name} {b / 1e9:.2f}"
                                                                  for name, b in activations.items()), ""]
        header += "".join(f"{'+ ' + name:>16}" for name in activations)
    rows.append(header)
    sizes = dict(param_bytes=param_bytes, grad_bytes=grad_bytes, k=k, frozen=frozen)
    base = estimate(num_params, world_size, 0, **sizes)
    for s in STAGES:
        b = estimate_breakdown(num_params, world_size, s, **sizes)
        total = b["params"] + b["grads"] + b["optimizer"]
        rows.append(f"{names[s]:20}{b['params'] / 1e9:11.2f}{b['grads'] / 1e9:11.2f}"
                    f"{b['optimizer'] / 1e9:11.2f}{total / 1e9:11.2f}{base / total:8.1f}x"
                    + "".join(f"{(total + a) / 1e9:16.2f}" for a in (activations or {}).values()))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m minizero.memory",
                       description="Per-rank model-state memory for each ZeRO stage, and a GPT's activations.")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="number of parameters Ψ, e.g. 7.5e9")
    what.add_argument("--model", choices=MODEL_NAMES, help="a built-in model's real parameter count")
    what.add_argument("--layers", type=int, help="a GPT of this many blocks (with --hidden, --seq, --batch)")
    ap.add_argument("--hidden", type=int, help="width h")
    ap.add_argument("--heads", type=int, help="attention heads a (default h/64, at least 1)")
    ap.add_argument("--seq", type=int, help="sequence length s")
    ap.add_argument("--batch", type=int, help="micro-batch b: rows per rank per forward")
    ap.add_argument("--vocab", type=int, default=GPT2_VOCAB, help=f"vocabulary, for Ψ (default {GPT2_VOCAB})")
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
        shape = (args.hidden, args.seq, args.batch)
        if args.layers is not None and not (args.layers >= 1 and all(v is not None and v >= 1 for v in shape)):
            raise UsageError("--layers needs --hidden, --seq and --batch, all >= 1")
        heads = args.heads or max(1, (args.hidden or 0) // 64)
        if args.layers is not None and args.hidden % heads:
            raise UsageError(f"--hidden {args.hidden} must be divisible by --heads {heads}")
    except UsageError as e:
        return fail(ap.prog, str(e))
    elem = element_bytes(args.dtype)
    activations = None
    if args.layers is not None:
        cfg = GPTConfig(n_layer=args.layers, n_embd=args.hidden, n_head=heads, block_size=args.seq,
                        vocab_size=args.vocab)
        psi = count_params(cfg)
        activations = {name: activation_bytes(args.layers, args.hidden, heads, args.seq, args.batch,
                                              bytes_per_elem=elem, mlp_ratio=cfg.mlp_ratio, checkpointing=mode)
                       for name, mode in (("kept", False), ("checkpointed", True), ("ckpt on host", "cpu"))}
    elif args.params is not None:
        psi = int(args.params)
    else:
        psi = GPT(GPTConfig.named(args.model)).num_params()
    frozen = int(args.frozen)
    if not 0 <= frozen < psi:
        return fail(ap.prog, "--frozen must be >= 0 and fewer than the parameters")
    print(_table(psi - frozen, args.world_size, elem, elem, optimizer_k(state_bytes("adamw"), args.dtype), frozen,
                 activations))
    return 0
