"""The command behind `python -m minizero.memory`: per-rank model states for each stage,
and activations.

    python -m minizero.memory --params 7.5e9 --world-size 64   # the paper's figure 1, any size
    python -m minizero.memory --model default --world-size 4       # minizero's small GPT
    # a GPT's shape: + its activations, kept and with checkpointing
    python -m minizero.memory --layers 48 --hidden 1600 --heads 25 --seq 1024 --batch 32 \
        --world-size 64
    python -m minizero.memory --model llama-7b --world-size 8 --seq 2048 --batch 1    # any model
    python -m minizero.memory --model gpt2 --world-size 8 --json gpt2.json   # + the numbers, bytes
    python -m minizero.memory --params 7.5e9 --world-size 64 --tensor-parallel 8   # a 2-D mesh
    python -m minizero.memory --table1           # the paper's Table 1: the largest model per stage
    python -m minizero.memory --table1 --measure --device-gb 0.001 --world-size 4   # ... measured

A GPT described by --layers/--hidden/--seq/--batch gets Ψ from its shape (lab.model.count_params,
with --vocab) and its activations per rank (memory.activation_bytes, micro-batch --batch) next to
the model states: kept for backward, and with activation checkpointing (each block's input, plus one
block's recompute), on the device or with the inputs on the host.

--model names minizero's GPTs (lab/model.py) or one of ARCHITECTURES, a `transformers` config
written here (no download). Either is built on the meta device (no memory) to count Ψ (a tied
weight once) and its largest layer; --seq/--batch add activations by memory.activation_bytes
(minizero's GPT block with the architecture's layers, width, heads and MLP ratio: for LLaMA's
three-matrix MLP, an approximation). Below the stages: stage 3's tiers (the optimizer state on the
host, the parameters too, the disk tier), and what DeepSpeed's estimate_zero3_model_states_mem_needs
(the numbers estimate_zero3_model_states_mem_needs_all_live prints) says for the same model and N.
"""

from __future__ import annotations

from minizero.cli import OneLineParser, UsageError, add_json_flag, emit, fail
from minizero.lab.model import GPT, MODEL_NAMES, SIZES, GPTConfig, count_params
from minizero.lab.train import state_bytes
from minizero.memory import (
    activation_bytes, element_bytes, estimate, estimate_breakdown, optimizer_k,
)
from minizero.memory.mesh import TABLE1_DATA_PARALLEL, TABLE1_DEVICE_BYTES, table1
from minizero.optim import DTYPES
from minizero.options import STAGES

GPT2_VOCAB = 50257
MEASURE_DEVICE_GB = 0.001           # --table1 --measure: 1 MB, GPTs of ~0.06-0.25 M parameters
CHECKPOINTING = (("kept", False), ("checkpointed", True), ("ckpt on host", "cpu"))   # activations
# Hugging Face configs (transformers class name, its arguments): the published shapes.
ARCHITECTURES = {
    "gpt2": ("GPT2Config", {}),
    "gpt2-xl": ("GPT2Config", {"n_layer": 48, "n_embd": 1600, "n_head": 25}),
    "llama-7b": ("LlamaConfig", {"hidden_size": 4096, "intermediate_size": 11008,
                                 "num_hidden_layers": 32, "num_attention_heads": 32,
                                 "vocab_size": 32000}),
    "llama-13b": ("LlamaConfig", {"hidden_size": 5120, "intermediate_size": 13824,
                                  "num_hidden_layers": 40, "num_attention_heads": 40,
                                  "vocab_size": 32000}),
}
TIERS = (("stage 3 + host", "optimizer"), ("stage 3 + params", "params"),
         ("stage 3 + disk", "disk"))


def report(num_params: int, world_size: int, param_bytes: int, grad_bytes: int, k: int,
           tier_k: dict, frozen: int = 0, activations: dict | None = None) -> dict:
    """Per-rank bytes of each stage (and each activation setting on top), then stage 3's tiers
    (tier_k: K for each offload): the table's numbers, and what --json writes."""
    sizes = dict(param_bytes=param_bytes, grad_bytes=grad_bytes, k=k, frozen=frozen)
    base = estimate(num_params, world_size, 0, **sizes)
    stages = []
    for s in STAGES:
        b = estimate_breakdown(num_params, world_size, s, **sizes)
        total = b["params"] + b["grads"] + b["optimizer"]
        stages.append({"stage": s, "params": b["params"], "grads": b["grads"],
                       "optimizer": b["optimizer"], "total": total, "vs_ddp": base / total,
                       "with_activations": {name: total + a
                                            for name, a in (activations or {}).items()}})
    tiers = []
    for name, offload in TIERS:
        b = estimate_breakdown(num_params, world_size, 3, offload=offload,
                               **{**sizes, "k": tier_k[offload]})
        tiers.append({"offload": offload, "name": name,
                      "device": b["params"] + b["grads"] + b["optimizer"],
                      "host": b["offloaded"], "disk": b["disk"]})
    return {"params": num_params + frozen, "frozen": frozen, "world_size": world_size,
            "tensor_parallel": 1,
            "bytes_per_param": {"params": param_bytes, "grads": grad_bytes, "optimizer_k": k},
            "activations": activations, "stages": stages, "tiers": tiers}


def _table(r: dict) -> str:
    """report()'s numbers as the command prints them, in GB."""
    names = {0: "DDP (baseline)", 1: "stage 1  P_os", 2: "stage 2  P_os+g", 3: "stage 3  P_os+g+p"}
    of_them = f" ({r['frozen']:,} of them frozen)" if r["frozen"] else ""
    per = r["bytes_per_param"]
    m, n = r["tensor_parallel"], f"N = {r['world_size']}"
    mesh = "" if m == 1 else (f" a rank (Ψ/M of {r['params'] * m:,}, M = {m} "
                              "tensor-parallel ranks)")
    if m > 1:
        n = f"N_d = {r['world_size']} (N = {r['world_size'] * m})"
    rows = [
        f"Ψ = {r['params']:,} parameters{of_them}{mesh}, {n}, bytes/param: params "
        f"{per['params']}, grads {per['grads']}, optimizer K = {per['optimizer_k']}",
        "",
    ]
    header = (
        f"{'':20}{'params GB':>11}{'grads GB':>11}{'optim GB':>11}{'total GB':>11}{'vs DDP':>9}"
    )
    activations = r["activations"] or {}
    if activations:
        rows[-1:] = [
            "",
            "activations per rank, GB: "
            + ", ".join(f"{name} {b / 1e9:.2f}" for name, b in activations.items()),
            "",
        ]
        header += "".join(f"{'+ ' + name:>16}" for name in activations)
    rows.append(header)
    for b in r["stages"]:
        rows.append(f"{names[b['stage']]:20}{b['params'] / 1e9:11.2f}{b['grads'] / 1e9:11.2f}"
                    f"{b['optimizer'] / 1e9:11.2f}{b['total'] / 1e9:11.2f}{b['vs_ddp']:8.1f}x"
                    + "".join(f"{t / 1e9:16.2f}" for t in b["with_activations"].values()))
    rows += ["", f"{'tiers (stage 3)':20}{'device GB':>11}{'host GB':>11}{'disk GB':>11}"]
    for t in r["tiers"]:
        rows.append(f"{t['name']:20}{t['device'] / 1e9:11.2f}{t['host'] / 1e9:11.2f}"
                    f"{t['disk'] / 1e9:11.2f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(
        prog="python -m minizero.memory",
        description="Per-rank model-state memory for each ZeRO stage, and a GPT's activations.",
    )
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="number of parameters Ψ, e.g. 7.5e9")
    what.add_argument("--model", choices=MODEL_NAMES + tuple(SIZES) + tuple(ARCHITECTURES),
                      help="a minizero GPT or a published architecture, counted on the meta device "
                           "(--seq, --batch: + activations)")
    what.add_argument(
        "--layers", type=int, help="a GPT of this many blocks (with --hidden, --seq, --batch)"
    )
    what.add_argument("--table1", action="store_true",
                      help="the ZeRO paper's Table 1: the largest model each stage fits per "
                           "model-parallel degree (--device-gb, default 32)")
    ap.add_argument("--device-gb", type=float, default=None,
                    help=f"with --table1: each device's memory, GB (default "
                         f"{TABLE1_DEVICE_BYTES / 1e9:g}; with --measure {MEASURE_DEVICE_GB:g})")
    ap.add_argument("--measure", action="store_true",
                    help="with --table1: at small scale, train the largest GPT that fits each "
                         "mesh of --world-size ranks (default 4) and stage, and the one a size "
                         "up (minizero/lab/table1.py)")
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="M",
                    help="ranks per tensor-parallel group: each holds Ψ/M, ZeRO shards it over "
                         "N_d = N/M (minizero/memory/mesh.py)")
    ap.add_argument("--hidden", type=int, help="width h")
    ap.add_argument("--heads", type=int, help="attention heads a (default h/64, at least 1)")
    ap.add_argument("--seq", type=int, help="sequence length s")
    ap.add_argument("--batch", type=int, help="micro-batch b: rows per rank per forward")
    ap.add_argument(
        "--vocab", type=int, default=GPT2_VOCAB, help=f"vocabulary, for Ψ (default {GPT2_VOCAB})"
    )
    ap.add_argument("--world-size", type=int, help="ranks N (required but with --table1)")
    ap.add_argument(
        "--frozen",
        type=float,
        default=0,
        help=(
            "of them, parameters that are frozen (Ψ_f: no "
            "gradient, no optimizer state; partitioned only at stage 3)"
        ),
    )
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                    help="bf16, fp16: 2+2 bytes, K=12 (paper); fp32: 4+4 bytes, K=8")
    add_json_flag(ap, "the numbers, in bytes (the table's rows as records),")
    try:
        args = ap.parse_args(argv)
        if args.measure and not args.table1:
            raise UsageError("--measure goes with --table1")
        if args.table1:
            device_gb = args.device_gb
            if device_gb is None:
                device_gb = MEASURE_DEVICE_GB if args.measure else TABLE1_DEVICE_BYTES / 1e9
            if not device_gb > 0:
                raise UsageError("--device-gb must be > 0")
            if args.measure:
                return _measure_table1(device_gb * 1e9,
                                       4 if args.world_size is None else args.world_size, args.json)
            rows = table1(device_gb * 1e9)
            emit(_table1(rows, device_gb), {"table1": rows}, args.json)
            return 0
        if args.world_size is None or args.world_size < 1:
            raise UsageError("--world-size must be given, >= 1")
        m = args.tensor_parallel
        if m < 1 or args.world_size % m:
            raise UsageError(f"--tensor-parallel must divide --world-size {args.world_size}, "
                             f"got {m}")
        if m > 1 and (args.seq is not None or args.layers is not None):
            raise UsageError("--tensor-parallel: activations under tensor parallelism are not "
                             "estimated yet; give --params or --model without --seq/--batch")
        if args.params is not None and not args.params >= 1:
            raise UsageError("--params must be >= 1")
        shape = (args.hidden, args.seq, args.batch)
        if args.layers is not None and not (
            args.layers >= 1 and all(v is not None and v >= 1 for v in shape)
        ):
            raise UsageError("--layers needs --hidden, --seq and --batch, all >= 1")
        if args.model is not None and (args.seq is None) != (args.batch is None):
            raise UsageError("--model takes --seq and --batch together (activations), or neither")
        if any(v is not None and v < 1 for v in (args.seq, args.batch)):
            raise UsageError("--seq and --batch must be >= 1")
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
        activations = {
            name: activation_bytes(
                args.layers, args.hidden, heads, args.seq, args.batch,
                bytes_per_elem=elem,
                mlp_ratio=cfg.mlp_ratio,
                checkpointing=mode,
            )
            for name, mode in CHECKPOINTING
        }
    elif args.params is not None:
        psi = int(args.params)
    else:
        shape = model_shape(args.model)
        psi = shape["params"]
        if args.seq is not None:
            activations = {name: activation_bytes(shape["layers"], shape["hidden"], shape["heads"],
                                                  args.seq, args.batch, bytes_per_elem=elem,
                                                  mlp_ratio=shape["mlp_ratio"], checkpointing=mode)
                           for name, mode in CHECKPOINTING}
    frozen = int(args.frozen)
    if not 0 <= frozen < psi:
        return fail(ap.prog, "--frozen must be >= 0 and fewer than the parameters")
    adam = state_bytes("adamw")
    tier_k = {offload: optimizer_k(adam, args.dtype, offload) for _, offload in TIERS}
    numbers = report((psi - frozen) // m, args.world_size // m, elem, elem,
                     optimizer_k(adam, args.dtype), tier_k, frozen // m, activations)
    numbers["tensor_parallel"] = m
    text = _table(numbers)
    numbers |= {"dtype": args.dtype, "deepspeed": None}
    if args.model is not None and m == 1:
        numbers["deepspeed"] = deepspeed_estimate(shape, args.world_size)
        text += "\n" + _deepspeed_table(shape, args.world_size, numbers["deepspeed"])
    emit(text, numbers, args.json)
    return 0


def _measure_table1(device_bytes: float, world_size: int, json_path) -> int:
    """--table1 --measure: lab/table1.py's rows, printed and written (--json "measured")."""
    from minizero.lab import table1 as small_scale
    if world_size < 1:
        raise UsageError("--world-size must be >= 1")
    try:
        small_scale.plan(device_bytes, world_size)              # too small a budget: one line
    except ValueError as e:
        raise UsageError(str(e)) from None
    rows = small_scale.measure(device_bytes, world_size)
    emit(small_scale.table(rows, device_bytes, world_size),
         {"device_bytes": device_bytes, "world_size": world_size, "measured": rows}, json_path)
    return 0


def _table1(rows: list[dict], device_gb: float) -> str:
    """table1()'s rows as the paper prints them: billions of parameters."""
    out = [f"The largest model whose model states fit {device_gb:g} GB per device (ZeRO paper, "
           f"Table 1: mixed-precision Adam, K = 12, {TABLE1_DATA_PARALLEL}-way data parallelism), "
           "billions of parameters", "",
           f"{'MP':>4}{'GPUs':>7}{'baseline':>11}{'P_os':>11}{'P_os+g':>11}{'P_os+g+p':>11}"]
    for r in rows:
        out.append(f"{r['model_parallel']:4}{r['gpus']:7}"
                   + "".join(f"{psi / 1e9:11.1f}" for psi in r["largest"]))
    return "\n".join(out)


def model_shape(name: str) -> dict:
    """Ψ (a tied weight once), the largest layer (the most parameters one module holds itself) and
    the block shape of a minizero GPT or an ARCHITECTURES entry, built on the meta device."""
    import torch
    with torch.device("meta"):
        if name in ARCHITECTURES:
            import transformers
            kind, kwargs = ARCHITECTURES[name]
            cfg = getattr(transformers, kind)(**kwargs)
            model = transformers.AutoModelForCausalLM.from_config(cfg)
            hidden = cfg.hidden_size
            mlp = getattr(cfg, "intermediate_size", None) or cfg.n_inner or 4 * hidden
            block = {"layers": cfg.num_hidden_layers, "hidden": hidden,
                     "heads": cfg.num_attention_heads, "mlp_ratio": mlp / hidden}
        else:
            cfg = GPTConfig.named(name)
            model = GPT(cfg)
            block = {"layers": cfg.n_layer, "hidden": cfg.n_embd, "heads": cfg.n_head,
                     "mlp_ratio": cfg.mlp_ratio}
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return {"params": sum(p.numel() for p in model.parameters()), "largest_layer": largest, **block}


def deepspeed_estimate(shape: dict, world_size: int) -> list[dict] | None:
    """DeepSpeed's own stage-3 estimate for the same model on one node of N devices (the numbers
    estimate_zero3_model_states_mem_needs_all_live prints; that one counts Ψ by data_ptr, which
    a meta model lacks, so Ψ and the largest layer are passed as counted here), or None without
    DeepSpeed. It adds 4 bytes a parameter of the largest layer (gathered in fp32) and counts 18
    bytes a parameter, 2 more than the paper's 16."""
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    except ImportError:
        return None
    rows = []
    for label, offload, params in (("no offload", False, False),
                                   ("optimizer on the host", True, False),
                                   ("+ parameters on the host", True, True)):
        host, device, _ = estimate_zero3_model_states_mem_needs(
            shape["params"], shape["largest_layer"], num_gpus_per_node=world_size,
            cpu_offload=offload, cpu_offload_params=params)
        rows.append({"name": label, "device": device, "host": host})
    return rows


def _deepspeed_table(shape: dict, world_size: int, rows: list[dict] | None) -> str:
    if rows is None:
        return "DeepSpeed is not installed: no comparison"
    return "\n".join(
        [f"DeepSpeed's stage-3 estimate (Ψ {shape['params']:,}, largest layer "
         f"{shape['largest_layer']:,}, N = {world_size} on one node):"]
        + [f"  {r['name']:26} per device {r['device'] / 1e9:8.2f} GB, host (the node, x1.5 "
           f"buffer) {r['host'] / 1e9:8.2f} GB" for r in rows])
