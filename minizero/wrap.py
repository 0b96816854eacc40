"""`minizero.wrap(model, stage, optimizer, offload=False, ...)`: one interface for every stage.

    engine = minizero.wrap(model, 3, functools.partial(torch.optim.AdamW, lr=1e-3), dtype="bf16")
    loss = loss_fn(engine(x), y); engine.backward(loss); engine.step()

Call it inside a process group (minizero.launch or torchrun); without one it runs as a single rank.
"""

from __future__ import annotations

from torch import nn

from minizero import comm
from minizero.assembled import ENGINES, Assembled
from minizero.beyond import activations, tensor_parallel, tensor_parallel_hf
from minizero.beyond.mesh import mesh as make_mesh
from minizero.beyond.muon import home as muon
from minizero.construct import partition_of
from minizero.options import check_options, check_positive_int, check_stage
from minizero.units import default_units
# which stage takes what: options.py
__all__ = ["check", "check_mesh", "check_options", "engine_class", "wrap"]


def engine_class(stage: int) -> type[Assembled]:
    """The engine of ZeRO `stage` (assembled.py: the paper's, with everything around it)."""
    return ENGINES[check_stage(stage)]


def check(
    stage: int,
    dtype: str = "fp32",
    offload: bool | str = False,
    reduce_dtype: str | None = None,
    *,
    shard_group_size: int | None = None,
    hpz_group_size: int | None = None,
    world_size: int | None = None,
    offload_path: str | None = None,
) -> None:
    """Raise ValueError (one line) if wrap would refuse this stage, dtype, offload, offload_path,
    reduce_dtype or group sizes at `world_size` ranks: for callers that want to know before they
    build a model or start processes."""
    engine_class(stage).check(dtype, offload, reduce_dtype, shard_group_size, hpz_group_size,
                              world_size, offload_path)


def wrap(model: nn.Module, stage: int, optimizer, offload: bool | str = False,
         activation_checkpointing: bool | str = False, offload_path: str | None = None,
         param_groups: list[dict] | None = None, muon_design: str | None = None,
         **options) -> Assembled:
    """Wrap `model` for ZeRO `stage` (0 = DDP).

    optimizer: a factory params -> torch.optim.Optimizer (it is handed the parameters this
    rank steps).
    param_groups: None (one group: every trainable parameter) or torch's groups over the model's
               parameters, [{"params": [...], "weight_decay": 0.0}, ...]: each group's settings
               override the factory's; the factory is then handed one group dict per user group
               ([Note: parameter groups] in optim.py). Trainable parameters in no group are not
               trained (DeepSpeed's rule; one warning line).
               With a factory that makes torch.optim.Muon, a group with use_muon=False is stepped
               by torch.optim.AdamW (embeddings, head, norms, biases); without groups, a
               parameter's use_muon attribute (DeepSpeed's convention) decides.
    muon_design: how Muon's matrices are orthogonalized whole at stages 1-3: "straddle" (the
               default), "whole" or "round_robin" (beyond/muon/home.py says what each is).
    offload:   stages 1-3: True/"optimizer" keeps optimizer state on the host; stage 3 also
               "params"; "disk": in a file in the folder offload_path (ZeRO-Infinity,
               beyond/disk.py).
    activation_checkpointing: True recomputes each unit's forward in backward, "cpu" also keeps the
               units' inputs on the host until then (beyond/activations.py); units as stage 3's
               (`units=` or units.default_units: a transformer's blocks), at every stage.
    options:   dtype ("fp32" | "bf16" | "fp16"), reduce_dtype (None | "fp32": bf16/fp16 gradients
               reduced and accumulated in fp32; flat.py), loss_scale (fp16: None = dynamic, a
               number = static, a dict = dynamic options; minizero/loss_scale.py), clip_grad_norm,
               bucket_size (bytes; stages 0, 2), overlap (stage 0; False: all-reduce every bucket
               after backward), buckets_in_flight (stages 0, 2, 3: gradient buckets whose collective
               may be in flight at once, default 2; more overlap, more memory), units and prefetch
               (stage 3),
               shard_group_size (stages 1-3: partition within groups of S ranks, replicate across
               them; HSDP / MiCS) and hpz_group_size (stage 3: ZeRO++'s hpZ, backward's all-gather
               within groups of R ranks, a node; beyond/hierarchical.py, hpz.py); ZeRO++
               (beyond/quantize.py): quantized_weights (stage 3's forward all-gather in int8, qwZ),
               quantized_gradients (stages 2-3: the reduce-scatter, qgZ), quantization_block
               (elements per fp32 scale, default quantize.BLOCK); tensor_parallel=M (every stage:
               rows of M ranks split the model, Megatron's way, and ZeRO shards along the columns;
               [Note: the 2-D mesh] in beyond/tensor_parallel.py): the model is split here
               (tensor_parallel_hf.parallelize) and its output is this rank's vocabulary slice of
               the logits (tensor_parallel.cross_entropy).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    engine = engine_class(stage)
    check_options(stage, options)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            "model has no trainable parameters (every parameter has requires_grad=False)"
        )
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            "the model's parameters are on the meta device (no values to train): build it inside "
            "`with minizero.sharded_init():` to create it partitioned over the ranks"
        )
    if stage != 3 and any(partition_of(p) is not None for p in model.parameters()):
        raise ValueError(
            f"the model was built under minizero.sharded_init, which partitions parameters for "
            f"stage 3; stage {stage} keeps full parameters: build it normally"
        )
    if "bucket_size" in options and not (isinstance(options["bucket_size"], (int, float))
                                         and not isinstance(options["bucket_size"], bool)
                                         and options["bucket_size"] > 0):
        raise ValueError(
            f"bucket_size must be a positive number of bytes, got {options['bucket_size']!r}"
        )
    for flag in ("prefetch", "overlap", "quantized_weights", "quantized_gradients"):
        if flag in options and not isinstance(options[flag], bool):
            raise TypeError(f"{flag} must be True or False, got {options[flag]!r}")
    check_positive_int(
        "quantization_block", options.get("quantization_block", 1), "number of elements"
    )
    check_positive_int(
        "buckets_in_flight", options.get("buckets_in_flight", 1), "number of buckets"
    )
    if "units" in options:
        mine = {id(m) for m in model.modules()}
        if not (isinstance(options["units"], (list, tuple, nn.ModuleList))
                and all(isinstance(u, nn.Module) and id(u) in mine for u in options["units"])):
            raise TypeError(
                "units must be a list of the model's submodules (e.g. list(model.blocks))"
            )
    # an optimizer that needs whole matrices (torch.optim.Muon) brings its home: beyond/muon/
    engine, param_groups = muon.muon_engine(engine, model, optimizer, param_groups, muon_design,
                                            offload, options)
    mesh = _mesh(model, options.pop("tensor_parallel", 1), options)
    if activation_checkpointing not in activations.MODES + activations.PARTITIONED:
        raise ValueError(
            "activation_checkpointing must be False, True, 'cpu', 'partitioned' or "
            f"'partitioned+cpu', got {activation_checkpointing!r}"
        )
    # the units, found before stage 3 frees the parameters (a transformer's blocks): what is
    # checkpointed, and what memory_timeline's events name
    units = list(options.get("units") or default_units(model))
    if stage == 3 and mesh is not None:
        tensor_parallel.check_tied_heads(model, units)
    built = engine(model, optimizer, offload=offload, offload_path=offload_path,
                   param_groups=param_groups, mesh=mesh, **options)
    if activation_checkpointing:            # P_a's group: only the partitioned modes take one
        partitioned = mesh is not None and activation_checkpointing in activations.PARTITIONED
        activations.checkpoint(units, activation_checkpointing, built.activations,
                               mesh[0] if partitioned else None)
    built.watch(units)
    return built


def check_mesh(m, world_size: int, options) -> None:
    """Raise ValueError (one line) unless tensor_parallel=m makes a mesh of `world_size` ranks with
    these options (names): the CLI asks before it starts processes, wrap again."""
    check_positive_int("tensor_parallel", m, "number of ranks")
    if world_size % m:
        raise ValueError(f"tensor_parallel={m} must divide the world size {world_size}")
    clashing = sorted({"shard_group_size", "hpz_group_size"} & set(options))
    if m > 1 and clashing:
        raise ValueError(f"tensor_parallel with {', '.join(clashing)}: not supported yet (both "
                         "cut the ranks into rows)")


def _mesh(model: nn.Module, m, options: dict) -> tuple[comm.Group, comm.Group] | None:
    """tensor_parallel=M: the 2-D mesh's groups (this rank's row, its column), the model split over
    the row in place; None for M = 1. [Note: the 2-D mesh] in beyond/tensor_parallel.py."""
    check_mesh(m, comm.world_size(), options)
    if m == 1:
        return None
    if any(partition_of(p) is not None for p in model.parameters()):
        raise ValueError("tensor_parallel: the model was built under minizero.sharded_init; build "
                         "it normally, tensor parallelism splits it first")
    mesh = make_mesh(m)
    tensor_parallel_hf.parallelize(model, mesh[0])
    return mesh
