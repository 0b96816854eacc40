"""From DeepSpeed, FairScale and PyTorch terms to the minizero code that implements the same idea.

    # the map as a Markdown table, line numbers taken from the code now
    python -m minizero.lab.concepts
    # regenerate docs/concepts.md (a test checks it is up to date)
    python -m minizero.lab.concepts --write

The table is data (`CONCEPTS`); file and line come from `inspect` at run time, so the map cannot
point at a line that has moved: when the code changes, regenerate the page.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

# (where the term comes from, the term, minizero symbol, how minizero's version relates)
CONCEPTS = [
    ("DeepSpeed", "zero_optimization.stage 0 / plain data parallelism", "minizero.stages.DDP",
     "stage 0: everything replicated, gradients all-reduced"),
    ("DeepSpeed", "zero_optimization.stage 1", "minizero.stages.Zero1",
     "P_os: optimizer states partitioned"),
    ("DeepSpeed", "zero_optimization.stage 2", "minizero.stages.Zero2",
     "P_os+g: + gradients partitioned"),
    ("DeepSpeed", "zero_optimization.stage 3", "minizero.stages.Zero3",
     "P_os+g+p: + parameters partitioned"),
    ("DeepSpeed", "flat partitions (stage_1_and_2 single_partition_of_fp32_groups)",
     "minizero.flat.FlatLayout", "flatten, pad to a multiple of N, one partition per rank"),
    ("DeepSpeed", "fp32 master weights / bf16.enabled", "minizero.optim.ShardOptimizer",
     "fp32 masters + optimizer state for the owned partition (K = 12)"),
    ("DeepSpeed", "reduce_bucket_size", "minizero.flat.split_into_buckets",
     "bucket size in bytes (DeepSpeed counts elements)"),
    ("DeepSpeed", "overlap_comm", "minizero.reducer.GradBuckets",
     "buckets launched from autograd hooks while backward runs"),
    ("DeepSpeed", "reduce_scatter (stage 2 gradient reduction)",
     "minizero.zero2.GradientShard.reduce", "one async reduce-scatter per bucket"),
    ("DeepSpeed", "contiguous_gradients", "minizero.zero2.GradientShard.stage",
     "each gradient copied into its bucket's buffer and freed at once"),
    ("DeepSpeed", "allgather_bucket_size (stage 1-2 parameter all-gather)",
     "minizero.ddp.ReplicatedParameters.after_step", "updated partitions all-gathered per bucket"),
    ("DeepSpeed", "partitioned_param_coordinator (stage 3 fetch/release)",
     "minizero.zero3.Unit.gather", "all-gather a unit before use; Unit.free releases it"),
    ("DeepSpeed", "stage3_prefetch_bucket_size", "minizero.zero3.ShardedUnits.following",
     "the next unit in recorded order is gathered ahead"),
    ("DeepSpeed", "offload_optimizer.device = cpu (ZeRO-Offload)",
     "minizero.offload.HostShardOptimizer", "masters and state on the host, step on the host"),
    ("DeepSpeed", "offload_param.device = cpu (ZeRO-Infinity)",
     "minizero.zero3.ShardedUnits", "parameter shards kept in host memory between uses"),
    (
        "DeepSpeed",
        "zero_quantized_weights (ZeRO++ qwZ)",
        "minizero.beyond.quantize.all_gather",
        "stage 3's forward all-gather in int8 blocks "
        "(Unit.gather); backward's all-gather stays exact",
    ),
    ("DeepSpeed", "zero_quantized_gradients (ZeRO++ qgZ)",
     "minizero.beyond.quantize.reduce_scatter",
     "int8 chunks in one all-to-all, averaged in fp32 (ZeRO++: a 2-hop all-to-all of int4)"),
    ("DeepSpeed", "ZeRO++ block-based quantization", "minizero.beyond.quantize.quantize",
     "symmetric int8, one fp32 scale per block of B: error <= absmax/254, Ψ + 4Ψ/B bytes"),
    ("DeepSpeed", "gradient_clipping", "minizero.engine.Engine._clip",
     "global norm over all partitions"),
    ("DeepSpeed", "fp16.loss_scale / DynamicLossScaler (hysteresis, loss_scale_window)",
     "minizero.loss_scale.LossScaler",
     "scale the loss, unscale in fp32, skip on overflow, halve / double S"),
    ("DeepSpeed", "has_overflow (all-reduce MAX of the overflow flag)",
     "minizero.loss_scale.found_overflow",
     "every rank takes the same skip decision, whatever shard the inf is in"),
    ("DeepSpeed", "data_types.grad_accum_dtype", "minizero.flat.FlatLayout.point_grads_into",
     "reduce_dtype='fp32': bf16/fp16 gradients added "
     "into fp32 buffers, reduced and accumulated there"),
    ("DeepSpeed", "gradient_accumulation_steps", "minizero.engine.Engine.no_sync",
     "no communication until the last micro-batch"),
    ("DeepSpeed", "train_micro_batch_size_per_gpu", "minizero.lab.data.local_batch",
     "the global batch is [accumulation][N][micro-batch rows]"),
    ("DeepSpeed", "estimate_zero2_model_states_mem_needs / estimate_zero3_...",
     "minizero.memory.estimate",
     "the paper's per-rank model-state bytes; `python -m minizero.memory`"),
    ("DeepSpeed", "activation_checkpointing (deepspeed.checkpointing.checkpoint)",
     "minizero.beyond.activations.checkpoint",
     "each unit's forward recomputed in backward; "
     "cpu_checkpointing keeps its inputs on the host (P_a+cpu)"),
    ("PyTorch", "torch.utils.checkpoint / checkpoint_wrapper",
     "minizero.beyond.activations.checkpoint",
     "the reentrant design, so that the recompute's saved tensors are measured too"),
    ("PyTorch", "saved_tensors_hooks (MemTracker's activation bytes)",
     "minizero.beyond.activations.SavedTensorMeter",
     "engine.memory()['activations']: peak bytes saved for backward, each storage once"),
    ("DeepSpeed", "save_checkpoint (ZeRO sharded checkpoint)", "minizero.checkpoint.save",
     "one file per rank, manifest written last"),
    ("DeepSpeed", "zero_to_fp32.py", "minizero.checkpoint.consolidate",
     "sharded checkpoint -> plain fp32 state_dict"),
    ("DeepSpeed", "ds_to_universal.py (universal checkpoint)", "minizero.checkpoint.universal",
     "whole optimizer state; engine.load reshards it at any stage and N"),
    ("DeepSpeed", "ds_config.json", "minizero.deepspeed.config.load_deepspeed_config",
     "the same keys, mapped or reported"),
    ("DeepSpeed", "deepspeed.initialize (engine.backward / engine.step per micro-batch)",
     "minizero.deepspeed.initialize.initialize",
     "the config's engine (wrap), optimizer and schedule; steps at the boundary"),
    ("DeepSpeed", "lr_schedules.WarmupLR / WarmupDecayLR / WarmupCosineLR",
     "minizero.deepspeed.config.WarmupLR", "the same learning rates, step for step"),
    ("FairScale", "FullyShardedDataParallel (FlatParameter, user's optimizer)",
     "minizero.fairscale.fsdp.FullyShardedDataParallel",
     "stage 3's engine; model.parameters() are this rank's flat shards, one per unit"),
    ("FairScale", "nested FSDP, enable_wrap + wrap, auto_wrap",
     "minizero.fairscale.fsdp_wrap.auto_wrap",
     "each FSDP instance is a unit; the outermost adopts the inner ones (one engine)"),
    ("FairScale", "FSDP summon_full_params",
     "minizero.fairscale.fsdp_state.StateMixin.summon_full_params",
     "every unit gathered, original names; each rank's writes persist in its partition"),
    ("FairScale", "FSDP gather_full_optim_state_dict",
     "minizero.fairscale.fsdp_state.StateMixin.gather_full_optim_state_dict",
     "the unwrapped model's optimizer state on rank 0; get_shard_from_optim_state_dict cuts it"),
    ("FairScale", "OSS (optimizer state sharding)", "minizero.stages.Zero1",
     "OSS gives whole parameters to ranks; minizero splits one flat buffer evenly"),
    ("FairScale", "ShardedDDP", "minizero.stages.Zero2", "gradients reduced to their owner only"),
    ("FairScale", "FSDP reshard_after_forward", "minizero.zero3.Unit.post_forward",
     "True is stage 3 (free after forward); False keeps them, like stage 2"),
    ("FairScale", "FSDP flatten_parameters", "minizero.flat.FlatLayout.point_params_into",
     "parameters become views of one flat buffer"),
    ("FairScale", "FSDP move_params_to_cpu", "minizero.zero3.Unit.gather",
     "offload='params': host shard copied to the device before the all-gather"),
    ("PyTorch", "DistributedDataParallel bucket_cap_mb", "minizero.flat.DEFAULT_BUCKET_BYTES",
     "25 MB buckets, in reverse parameter order"),
    ("PyTorch", "DDP gradient_as_bucket_view", "minizero.flat.FlatLayout.point_grads_into",
     "p.grad is a view of the flat gradient buffer"),
    ("PyTorch", "DDP Reducer (autograd hooks, in-order buckets)", "minizero.reducer.GradBuckets",
     ""),
    ("PyTorch", "DDP no_sync()", "minizero.engine.Engine.no_sync", ""),
    ("PyTorch", "DistributedDataParallel (your optimizer, loss.backward())",
     "minizero.pytorch.ddp.DistributedDataParallel",
     "stage 0's buckets and all-reduce without the engine; finished in an autograd callback"),
    ("PyTorch", "DDP find_unused_parameters", "minizero.reducer.GradBuckets.mark_ready",
     "parameters forward did not reach count ready at once; grad None if no rank used them"),
    ("PyTorch", "ZeroRedundancyOptimizer",
     "minizero.pytorch.zero_redundancy.ZeroRedundancyOptimizer",
     "whole parameters per rank, broadcast from their owner; stage 1 (stages.Zero1) cuts one flat "
     "buffer evenly instead"),
    ("PyTorch", "FSDP2 fully_shard", "minizero.pytorch.fully_shard.fully_shard",
     "one unit per call; each parameter a dim-0 DTensor shard (the per-parameter layout); "
     "stages.Zero3 is the same lifecycle over flat buffers"),
    ("PyTorch", "FSDP auto_wrap_policy / fully_shard on each block", "minizero.units.default_units",
     "default units: a transformer's blocks plus the root, else submodules of at most Ψ/8"),
    ("DeepSpeed", "deepspeed.zero.Init", "minizero.construct.sharded_init",
     "parameters partitioned as each module is built; later writes gathered and re-partitioned"),
    ("DeepSpeed", "deepspeed.zero.GatheredParameters(modifier_rank=...)",
     "minizero.assembled.Assembled.gathered",
     "full parameters between steps; rank r's writes reach every rank and the masters"),
    ("PyTorch", "FSDP summon_full_params(writeback=True)", "minizero.assembled.Assembled.gathered",
     ""),
    ("PyTorch", "FSDP2 FSDPParamGroup (unshard / reshard, training state)", "minizero.zero3.Unit",
     "one unit's buffers, state and lifecycle; its training state recognises recomputation"),
    ("PyTorch", "FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16)",
     "minizero.optim.fp32_master",
     "bf16 parameters for compute, fp32 master copy for the step"),
    ("PyTorch", "FSDP2 MixedPrecisionPolicy(reduce_dtype=float32)",
     "minizero.flat.FlatLayout.point_grads_into",
     "wrap(reduce_dtype='fp32'): 4 bytes a gradient, gradient collectives at 4 bytes an element"),
    ("PyTorch", "torch.amp.GradScaler", "minizero.loss_scale.LossScaler",
     "GradScaler's growth/backoff without DeepSpeed's hysteresis; minizero follows DeepSpeed"),
    ("PyTorch", "FSDP2 reshard_after_forward", "minizero.zero3.Unit.post_forward", ""),
    ("PyTorch", "FSDP2 CPUOffloadPolicy", "minizero.offload.HostShardOptimizer",
     "FSDP2 offloads parameters and gradients; minizero the optimizer (and parameters in stage 3)"),
    (
        "PyTorch",
        "torch.distributed reduce_scatter_tensor / all_gather_into_tensor",
        "minizero.comm.reduce_scatter",
        (
            "and minizero.comm.all_gather: the only callers, with "
            "a byte tally; on gloo run as an all-reduce and as N "
            "broadcasts, faster there ([Note: collectives on "
            "gloo], python -m minizero.bench --collectives)"
        ),
    ),
    (
        "DeepSpeed",
        "comms_logger (per-collective time, algbw / busbw = algbw · 2(n-1)/n)",
        "minizero.beyond.network.Network",
        "a model, not a measurement: each collective waits for "
        "its ring's hops·α + bytes/β on a modelled cluster; "
        "network.tally() splits intra/inter-node bytes",
    ),
    ("DeepSpeed", "overlap_comm: false", "minizero.reducer.GradBuckets",
     "wrap(model, 0, overlap=False): every bucket after backward, to measure what overlap hides"),
    (
        "PyTorch",
        "FSDP2 HSDP: fully_shard(mesh=2-D DeviceMesh ('replicate', 'shard'))",
        "minizero.beyond.mesh.mesh",
        (
            "wrap(shard_group_size=S), stages 1-3: shard in "
            "rows of S ranks, replicate across the N/S columns "
            "([Note: hierarchical sharding], beyond/hierarchical.py); tested against FSDP2's HSDP"
        ),
    ),
    (
        "DeepSpeed",
        "MiCS (mics_shard_size, hierarchical gradient all-reduce)",
        "minizero.beyond.hierarchical.average_across",
        (
            "gradients reduce-scattered in the shard group, the "
            "partition all-reduced across groups at step(); "
            "memory with S in place of N (minizero.memory.estimate(shard_group_size=S))"
        ),
    ),
    (
        "DeepSpeed",
        "ZeRO++ hpZ (zero_hpz_partition_size, secondary partition)",
        "minizero.beyond.hpz.HpzUnit._keep_secondary",
        (
            "wrap(3, hpz_group_size=R): backward's all-gather "
            "within a node; inter-node bytes 3Ψ -> 2Ψ for Ψ/R "
            "more parameter memory (minizero.memory.comm_volume_by_node, secondary_partition_bytes)"
        ),
    ),
]

ROOT = Path(__file__).resolve().parents[2]


def resolve(symbol: str):
    """Import 'minizero.zero2.GradientShard.reduce' -> the object."""
    parts = symbol.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(symbol)


def location(symbol: str) -> tuple[str, int]:
    """(path relative to the repository, line) where `symbol` is defined."""
    obj = inspect.unwrap(resolve(symbol))           # through decorators such as @contextmanager
    if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismethod(obj):
        source, line = inspect.getsourcelines(obj)
        path = inspect.getsourcefile(obj)
        # past decorators
        line += next(i for i, text in enumerate(source) if not text.lstrip().startswith("@"))
    else:                                     # a module-level constant: find its assignment
        module = importlib.import_module(symbol.rsplit(".", 1)[0])
        path = inspect.getsourcefile(module)
        name = symbol.rsplit(".", 1)[1]
        lines = Path(path).read_text().splitlines()
        line = next(i for i, text in enumerate(lines, 1) if text.split("=")[0].strip() == name)
    return str(Path(path).resolve().relative_to(ROOT)), line


def concept_rows() -> list[dict]:
    rows = []
    for source, term, symbol, note in CONCEPTS:
        path, line = location(symbol)
        rows.append(
            {
                "source": source,
                "term": term,
                "symbol": symbol,
                "path": path,
                "line": line,
                "note": note,
            }
        )
    return rows


# One parameter through stage 3 (docs/concepts.md): the calls its values, its gradient and its shard
# go through, in the order they run, from wrap to the shard's update. comm.py (the collectives)
# and torch are the floor every walk ends on, not steps of it. tests/test_concepts.py runs a
# stage-3 step and checks that these calls happen in this order.
WALK = [
    ("build", "minizero.wrap.wrap", "checks the options; the engine of stage 3's row (stages.py)"),
    ("build", "minizero.engine.Engine.__init__",
     "casts p, broadcasts rank 0's values, builds the row's families top to bottom"),
    ("build", "minizero.zero3.ShardedUnits.__init__",
     "P_p: p's unit (units.py), the units laid end to end (flat.py), the shard [Ψ/N]"),
    ("build", "minizero.zero3.Unit.__init__",
     "the unit's full buffer, p a view of it; this rank's partition copied into the shard"),
    ("build", "minizero.zero3.Unit.free", "the full buffer released: p is absent (absent.py)"),
    ("build", "minizero.zero2.GradientShard.__init__", "P_g: the gradient shard [Ψ/N]"),
    ("build", "minizero.optim.ShardOptimizer.__init__",
     "P_os: fp32 masters and state for each unit's shard, nothing else"),
    ("forward", "minizero.zero3.ShardedUnits._pre_forward", "the unit's module is called"),
    ("forward", "minizero.zero3.Unit.pre_forward", "FORWARD; gather it, prefetch the next"),
    ("forward", "minizero.zero3.Unit.gather",
     "all-gather the N partitions into the full buffer: p is a view of it, the module computes"),
    ("forward", "minizero.zero3.ShardedUnits._post_forward",
     "its forward is done; a hook on its output waits for backward"),
    ("forward", "minizero.zero3.Unit.post_forward", "IDLE; free it: p absent again"),
    ("backward", "minizero.engine.Engine.backward",
     "params.before_backward (units.py: every unit PRE_BACKWARD, a forward now is a "
     "recompute), loss.backward()"),
    ("backward", "minizero.zero3.Unit.pre_backward", "its output's gradient arrived: gather again"),
    ("backward", "minizero.reducer.GradBuckets._on_grad_ready",
     "p's gradient is complete: staged into its bucket's buffer, p.grad freed "
     "(GradientShard.stage)"),
    ("backward", "minizero.engine.Engine._bucket_ready", "every gradient of the unit is complete"),
    ("backward", "minizero.zero3.ShardedUnits.bucket_ready", "the bucket is the unit"),
    ("backward", "minizero.zero3.Unit.post_backward", "reduce-scatter its gradients, free it"),
    ("backward", "minizero.zero2.GradientShard.reduce",
     "the async reduce-scatter: rank r receives the average of partition r"),
    ("backward", "minizero.zero2.GradientShard.arrived", "added into the gradient shard"),
    ("step", "minizero.engine.Engine.step", "clip, step, zero"),
    ("step", "minizero.zero2.GradientShard.parts", "p's averaged gradient partition"),
    ("step", "minizero.optim.ShardOptimizer.step",
     "fp32 master <- Adam; the shard <- master: p's next gather reads it"),
]


def walk_rows() -> list[dict]:
    return [{"phase": phase, "symbol": symbol, "what": what,
             **dict(zip(("path", "line"), location(symbol)))} for phase, symbol, what in WALK]


def walk_markdown(link_prefix: str = "../") -> str:
    rows = walk_rows()
    files = sorted({r["path"] for r in rows})
    out = ["", "## One parameter through stage 3", "",
           f"`minizero.wrap(model, 3, optimizer)`, then one step: {len(rows)} calls in "
           f"{len(files)} files ({', '.join(Path(f).name for f in files)}), in the order they run "
           "(tests/test_concepts.py traces a step and checks it). Below them is comm.py, the door "
           "every collective passes.", "",
           "| phase | call | where | what happens to the parameter |", "|---|---|---|---|"]
    for r in rows:
        short = r["symbol"].removeprefix("minizero.")
        out.append(f"| {r['phase']} | `{short}` | [{r['path']}:{r['line']}]"
                   f"({link_prefix}{r['path']}#L{r['line']}) | {r['what']} |")
    return "\n".join(out) + "\n"


# The three front ends to the same engine, side by side (docs/concepts.md ends with it).
FRONT_ENDS = """
## The front ends: who owns the optimizer

```python
# minizero.wrap: the engine owns the optimizer (a factory: it is built over this rank's partition)
engine = minizero.wrap(model, 3, functools.partial(torch.optim.AdamW, lr=1e-3))
loss = loss_fn(engine(x), y); engine.backward(loss); engine.step()

# DeepSpeed's way (minizero/deepspeed/initialize.py): the config names the optimizer and the
# schedule,
# the engine counts micro-batches and steps both at the boundary
engine, optimizer, _, lr_scheduler = minizero.initialize(model=model, config="ds_config.json")
loss = loss_fn(engine(x), y); engine.backward(loss); engine.step()      # every micro-batch

# FairScale's way (minizero/fairscale/fsdp.py): the user owns the optimizer, over the flat shards
model = minizero.FullyShardedDataParallel(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)              # one FlatParameter per unit
loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()

# PyTorch's way (minizero/pytorch/): the user owns the optimizer over the model's own parameters
model = minizero.DistributedDataParallel(model)         # stage 0's buckets, finished in backward
optimizer = minizero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
# or FSDP2: minizero.fully_shard(block) for each block, then minizero.fully_shard(model)
loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()
```

The first three run the same stage-3 engine and units (zero3.py). What differs is where the step
happens: inside `engine.step()` (wrap, initialize), or in the user's optimizer, which can only step
what it is given. So FairScale's wrapper hands out the partitions themselves as parameters, and
finds the end of backward on its own (there is no `engine.backward` to call) to leave each shard's
averaged gradient in its `.grad`. tests/test_fsdp.py and tests/test_initialize.py check that each
ends where one process (and DeepSpeed) ends.

FairScale's FSDP as its users write it: FSDP instances nested in the model (or
`minizero.fsdp_wrap`'s `enable_wrap` / `wrap` / `auto_wrap`) are the units; `no_sync()`,
`clip_grad_norm_(max_norm, norm_type)`, `summon_full_params(recurse, volatile)`, `state_dict`,
`local_state_dict` with `consolidate_shard_weights`, and `gather_full_optim_state_dict` with
`get_shard_from_optim_state_dict` do what FairScale's do (tests/test_fairscale_scenarios.py ports
FairScale's own test scenarios). Its constructor keywords (minizero/fairscale/fsdp_options.py) are
implemented with FairScale's meaning, accepted with one warning line where they change only speed
(`flatten_parameters=False`, `bucket_cap_mb`, `process_group_reduce_scatter`,
`gradient_predivide_factor`, `clear_autocast_cache`), or refused in one line where they cannot
apply: a process group that is not every rank and `no_broadcast_optim_state` (mixture of experts:
one engine shards over all N), `move_params_to_cpu` on a GPU (minizero.wrap's `offload` does it).

PyTorch's way keeps the model's own parameters: DistributedDataParallel averages their gradients
in place (stage 0's buckets and all-reduce, without the engine); ZeroRedundancyOptimizer gives each
rank whole parameters to step and broadcasts them; fully_shard makes each parameter its own dim-0
shard, the second layout beside the flat buffers (notebooks/12_two_layouts). Each is tested against
torch's own on torch's own test scenarios (tests/test_pytorch_ddp.py, tests/test_zero_redundancy.py,
tests/test_fully_shard*.py).
"""


def to_markdown(link_prefix: str = "../") -> str:
    out = [
        "# Concept map: DeepSpeed, FairScale and PyTorch terms in minizero",
        "",
        "Generated by `python -m minizero.lab.concepts --write` "
        "from `minizero/lab/concepts.py`; line numbers are",
        "read from the code, and `tests/test_concepts.py` fails when this page is out of date.", "",
        "| from | term | minizero | where | note |", "|---|---|---|---|---|",
    ]
    for r in concept_rows():
        short = r["symbol"].removeprefix("minizero.")
        out.append(f"| {r['source']} | {r['term']} | `{short}` | [{r['path']}:{r['line']}]"
                   f"({link_prefix}{r['path']}#L{r['line']}) | {r['note']} |")
    return "\n".join(out) + "\n" + walk_markdown(link_prefix) + FRONT_ENDS


DOC = ROOT / "docs" / "concepts.md"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--write"]):
        print("python -m minizero.lab.concepts: error: the only option is --write", file=sys.stderr)
        return 2
    text = to_markdown()
    if argv == ["--write"]:
        DOC.parent.mkdir(exist_ok=True)
        DOC.write_text(text)
        print(f"wrote {DOC.relative_to(ROOT)}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
