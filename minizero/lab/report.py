"""Theory next to measurement for a training run: the paper's formulas for its settings, the
per-rank results collected into one summary, and the table `python -m minizero.run` prints.

    from minizero.lab.report import summarize, format_table
    print(format_table(summarize(cfg, minizero.launch(train_worker, cfg.world_size, cfg))))
"""

from __future__ import annotations

import statistics

from minizero.lab.data import sequence_length
from minizero.lab.throughput import format_throughput, throughput
from minizero.lab.train import TrainConfig, state_bytes
from minizero.memory import (
    activation_bytes, comm_volume, element_bytes, estimate_breakdown, grad_bytes, optimizer_k,
)
from minizero.memory.mesh import gpt_tensor_parallel_bytes


def run_k(cfg: TrainConfig) -> int:
    """K of the paper for this run (memory.optimizer_k: the optimizer's state plus any
    fp32 master)."""
    return optimizer_k(state_bytes(cfg.optimizer, cfg.optimizer_params), cfg.dtype, cfg.offload)


def theory(cfg: TrainConfig, num_params: int, num_frozen: int = 0) -> dict:
    """The paper's per-rank bytes and bytes sent per step for this run (minizero.memory), for a
    model of num_params parameters of which num_frozen are frozen; and the GPT's activations for one
    micro-batch of this rank's rows (memory.activation_bytes)."""
    elem, trainable = element_bytes(cfg.dtype), num_params - num_frozen
    grad = grad_bytes(cfg.dtype, cfg.reduce_dtype)              # 4 with reduce_dtype="fp32"
    # on a mesh num_params is a rank's part, sharded over its column (minizero/memory/mesh.py)
    n_d = cfg.world_size // cfg.tensor_parallel
    b = estimate_breakdown(trainable, n_d, cfg.stage, param_bytes=elem, grad_bytes=grad,
                           k=run_k(cfg), offload=cfg.offload, frozen=num_frozen,
                           shard_group_size=cfg.shard_group_size)
    m = cfg.model_config()
    rows = cfg.batch_size // (n_d * cfg.grad_accum)
    tensor_parallel = 0.0
    if cfg.tensor_parallel > 1:
        tensor_parallel = cfg.grad_accum * gpt_tensor_parallel_bytes(
            rows, sequence_length(m.block_size), m.n_embd, cfg.tensor_parallel, layers=m.n_layer,
            bytes_per_elem=elem, recompute=bool(cfg.activation_checkpointing))
    activations = activation_bytes(
        m.n_layer,
        m.n_embd,
        m.n_head,
        sequence_length(m.block_size),
        rows,
        bytes_per_elem=elem,
        mlp_ratio=m.mlp_ratio,
        checkpointing=cfg.activation_checkpointing,
        tensor_parallel=cfg.tensor_parallel,
    )
    return {
        **b,
        "device_total": b["params"] + b["grads"] + b["optimizer"],
        "activations": activations,
        "comm_bytes_per_step": tensor_parallel + comm_volume(
            trainable,
            n_d,
            cfg.stage,
            bytes_per_elem=elem,
            grad_bytes=grad,
            frozen=num_frozen,
            quantized_weights=cfg.quantized_weights,
            quantized_gradients=cfg.quantized_gradients,
            shard_group_size=cfg.shard_group_size,
            hpz_group_size=cfg.hpz_group_size,
        ),
    }


def summarize(cfg: TrainConfig, results: list[dict], network=None) -> dict:
    """The run's results and theory in one dict (network: the minizero.beyond.network.Network it
    modelled, if any)."""
    num_params, num_frozen = results[0]["num_params"], results[0]["num_frozen"]
    losses = [
        statistics.fmean(r["losses"][i] for r in results) for i in range(len(results[0]["losses"]))
    ]
    times = results[0]["step_times"][1:] or results[0]["step_times"]     # step 1 includes warm-up
    return {
        "stage": cfg.stage,
        "world_size": cfg.world_size,
        "backend": results[0]["backend"],
        "device": results[0]["device"],
        "num_params": num_params,
        "num_frozen": num_frozen,
        "dtype": cfg.dtype,
        "reduce_dtype": cfg.reduce_dtype,
        "offload": cfg.offload,
        "synchronous": cfg.synchronous,       # no collective overlapped another (comm.synchronous)
        "losses": losses,
        "shard_group_size": cfg.shard_group_size,
        "hpz_group_size": cfg.hpz_group_size,
        "tensor_parallel": cfg.tensor_parallel,
        "ranks": [
            {
                "rank": r["rank"],
                "memory": r["memory"],
                "comm_bytes_per_step": r["comm_bytes_per_step"],     # modelled: the ring formula
                "wire_bytes_per_step": r.get("wire_bytes_per_step"),  # measured (None: n/a)
            }
            for r in results
        ],
        "wire_unavailable": results[0].get("wire_unavailable"),     # why n/a, or None
        "theory": theory(cfg, num_params, num_frozen),
        "step_time_s": statistics.median(times),
        "step_times_s": times,  # rank 0's timed steps: the spread behind that median
        # tokens/s, achieved FLOP/s and MFU against the ranks' summed GEMM peak (lab/throughput.py)
        "throughput": throughput(
            cfg.model_config(),
            cfg.batch_size,
            statistics.median(times),
            cfg.world_size,
            sum(r.get("gemm_flops_per_s", 0.0) for r in results) or None,
            cfg.activation_checkpointing,
        ),
        # fp16: the loss scale after the last step and the steps skipped on overflow (every
        # rank agrees)
        "loss_scale": results[0]["loss_scale"],
        "skipped_steps": results[0]["skipped_steps"],
        "network": None if network is None else str(network),
    }


# Why a collective's measured bytes differ from the ring's (docs/performance.md, "Bytes on the
# wire"); every one also carries gloo's headers
WHY = {"all_reduce": "a ring all-reduce, as modelled",
       "reduce_scatter": "gloo runs an all-reduce, then a copy (comm.py): 2x",
       "all_gather": "gloo runs N broadcasts: the ring's bytes in all",
       "broadcast": "gloo's tree: the root sends S to each child",
       "all_to_all": "N-1 chunks out, as modelled",
       "overlapped": "sent while two kinds were in flight: --synchronous parts them",
       "total": "+ gloo's headers; docs/performance.md: the ratio by stage"}


def format_wire(summary: dict) -> list[str]:
    """Rank 0's bytes per step by collective: modelled (comm's tally) next to measured
    (memory/wire.py), with the reason each differs; "n/a" where nothing could be measured."""
    kb = lambda x: f"{x / 1e3:10.1f}"      # noqa: E731
    first = summary["ranks"][0]
    modelled, measured = first["comm_bytes_per_step"], first.get("wire_bytes_per_step")
    kinds = [k for k in WHY if k != "total" and (modelled.get(k) or (measured or {}).get(k))]
    lines = ["rank 0's bytes per step by collective (kB): modelled = the ring formula comm "
             "tallies, measured = on the wire",
             f"  {'collective':<15}{'modelled':>10}{'measured':>10}{'ratio':>7}  why they differ"]
    for kind in kinds + ["total"]:
        model = modelled.get(kind, 0.0)
        got = "n/a" if measured is None else kb(measured.get(kind, 0))
        exact = measured is not None and (kind == "total" or not measured.get("overlapped"))
        ratio = f"{measured.get(kind, 0) / model:.2f}" if exact and model else ""
        shown = kb(model) if kind != "overlapped" else ""
        why = WHY[kind]
        lines.append(f"  {kind:<15}{shown:>10}{got:>10}{ratio:>7}  {why}")
    if measured is None:
        lines.append(f"  measured: n/a ({summary.get('wire_unavailable') or 'not measured'})")
    return lines


def format_table(summary: dict) -> str:
    kb = lambda x: f"{x / 1e3:9.1f}"      # noqa: E731
    th = summary["theory"]
    off = f", offload={summary['offload']}" if summary["offload"] else ""
    reduce = f", gradients in {summary['reduce_dtype']}" if summary.get("reduce_dtype") else ""
    if summary.get("shard_group_size"):
        off += f", shard groups of S = {summary['shard_group_size']}"
    if summary.get("synchronous"):
        off += ", synchronous collectives"
    if summary.get("hpz_group_size"):
        off += f", hpZ groups of R = {summary['hpz_group_size']}"
    m = summary.get("tensor_parallel", 1)
    if m > 1:       # Ψ is then a rank's part of the model
        off += f", tensor-parallel rows of M = {m} x N_d = {summary['world_size'] // m}"
    lines = [
        f"stage {summary['stage']}, N = {summary['world_size']}, Ψ = {summary['num_params']:,} "
        f"parameters, {summary['dtype']}{reduce}{off}, {summary['backend']} on "
        f"{summary['device']}   (kB per rank; theory = ZeRO paper)",
        f"{'rank':>4} {'params':>9} {'grads':>9} {'optim':>9} {'offload':>9} {'device':>9} "
        f"{'peak':>9} {'comm/step':>10} {'wire/step':>10} {'activ.':>9}",
    ]
    for r in summary["ranks"]:
        m, wire = r["memory"], r.get("wire_bytes_per_step")
        device = m["params"] + m["grads"] + m["optimizer"]
        lines.append(
            f"{r['rank']:>4} {kb(m['params'])} {kb(m['grads'])} {kb(m['optimizer'])} "
            f"{kb(m['offloaded'])} {kb(device)} {kb(m['peak'])} "
            f"{kb(r['comm_bytes_per_step']['total'])}  "
            f"{kb(wire['total']) if wire else 'n/a':>9} "
            f"{kb(m['activations'])}"
        )
    lines.append(
        f"{'th.':>4} {kb(th['params'])} {kb(th['grads'])} "
        f"{kb(th['optimizer'])} {kb(th['offloaded'])} "
        f"{kb(th['device_total'])} {'':>9} {kb(th['comm_bytes_per_step'])} {'':>10} "
        f"{kb(th['activations'])}"
    )
    lines.append("comm/step: modelled (the ring's bytes, comm.tally); wire/step: measured (what "
                 "gloo wrote)")
    lines += format_wire(summary)
    losses = summary["losses"]
    lines.append(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps (the mean of "
                 f"the ranks' losses: the global batch's); median step time "
                 f"{summary['step_time_s'] * 1e3:.1f} ms")
    lines.append(format_throughput(summary["throughput"]))
    if summary.get("network"):
        sent = summary["ranks"][0]["comm_bytes_per_step"]
        lines.append(
            f"network model {summary['network']}: rank 0 "
            f"sent {kb(sent['intra_node']).strip()} kB per "
            f"step inside its node, {kb(sent['inter_node']).strip()} kB across nodes"
        )
    if summary["dtype"] == "fp16":
        lines.append(
            f"fp16 loss scale {summary['loss_scale']:g}; "
            f"{summary['skipped_steps']} steps skipped on overflow"
        )
    return "\n".join(lines)
