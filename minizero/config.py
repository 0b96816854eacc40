"""DeepSpeed-style JSON configs, read for the CLI and for `minizero.initialize`.

    python -m minizero.run --config ds_config.json --world-size 4
    engine, optimizer, _, lr_scheduler = minizero.initialize(model=model, config="ds_config.json")

    {"train_batch_size": 64, "gradient_accumulation_steps": 2,
     "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}

`load_deepspeed_config(path_or_dict, world_size)` turns such a file into settings named as
`minizero.lab.train.TrainConfig`'s fields (stage, offload, dtype, batch_size, grad_accum, optimizer,
lr, scheduler...), plus warnings. The policy (docs/deepspeed_config.md):
  * a key minizero implements is applied (`KEYS` below says to what);
  * a key DeepSpeed has but minizero does not implement gives one warning naming the key and what
    minizero does instead (`NOT_IMPLEMENTED`; `ALWAYS_ON` keys warn only when set to false);
  * an unknown key, a wrong type or an impossible value is an error (ConfigError, one line): a typo
    such as "zero_optimisation" must never be silently ignored;
  * "auto" (Hugging Face Trainer / Accelerate configs) means "not set here": for the CLI minizero's
    default or the command-line flag decides; for minizero.initialize (flags=False) it is resolved
    where DeepSpeed's batch rule or the model's hidden size decides it (Hugging Face's rules), and
    is an error anywhere else (there is no Trainer to fill it in).
Batch sizes follow DeepSpeed's rule train_batch_size = micro_batch x accumulation x world size: any
two determine the third, and three that disagree are an error.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from typing import Any, ClassVar

import torch

from minizero.loss_scale import DYNAMIC_DEFAULTS
from minizero.memory import element_bytes
from minizero.wrap import check

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


class ConfigError(ValueError):
    """A config that cannot be used, in one line naming the key."""


# Keys minizero applies, and what they become (for the docs and --help).
KEYS = {
    "train_batch_size": "batch_size (global rows per step)",
    "train_micro_batch_size_per_gpu": "rows per rank per micro-batch (determines batch_size / "
        "grad_accum)",
    "gradient_accumulation_steps": "grad_accum",
    "gradient_clipping": "clip_grad_norm (0 = off; absent: 1.0, DeepSpeed's default)",
    "bf16.enabled": "dtype = bf16 (fp32 master weights)",
    "fp16.enabled": "dtype = fp16 (fp32 master weights, loss scaling); with bf16.enabled too: an "
        "error",
    "fp16.loss_scale": "loss_scale: 0 = dynamic (default), > 0 = static",
    "fp16.initial_scale_power": "dynamic loss scale starts at 2**power (default 16)",
    "fp16.loss_scale_window": "good steps before the scale doubles (default 1000)",
    "fp16.hysteresis": "overflows before the scale halves (default 2)",
    "fp16.min_loss_scale": "the lowest dynamic scale (default 1)",
    "data_types.grad_accum_dtype": "reduce_dtype: \"fp32\" reduces and accumulates bf16/fp16 "
        "gradients in fp32; the compute dtype: as without it",
    "zero_optimization.stage": "stage (0 = DDP)",
    "zero_optimization.offload_optimizer.device": "offload = optimizer ('cpu'), disk ('nvme': "
        "ZeRO-Infinity's disk tier, disk.py) or off ('none')",
    "zero_optimization.offload_optimizer.nvme_path": "offload_path: the folder of the disk tier's "
        "files",
    "stall_timeout": "minizero's own: stop a run in which no collective finishes for this many "
        "seconds while a rank waits, naming the rank out of step (desync.py; 0: off)",
    "zero_optimization.offload_param.device": "offload = params ('cpu', stage 3 only)",
    "zero_optimization.reduce_bucket_size": "bucket_size in bytes = elements x 2 (bf16) or 4 "
        "(fp32); stages 0 and 2 (stage 1 has one bucket, stage 3 one per unit)",
    "zero_optimization.stage3_prefetch_bucket_size": "prefetch (0 = off; any other size = one "
        "unit ahead)",
    "zero_optimization.zero_quantized_weights": "quantized_weights: ZeRO++ qwZ, stage 3's forward "
        "all-gather in int8",
    "zero_optimization.zero_quantized_gradients": "quantized_gradients: ZeRO++ qgZ, the gradient "
        "reduce-scatter in int8 (stages 2-3; one hop, not ZeRO++'s 2-hop int4)",
    "zero_optimization.mics_shard_size": "shard_group_size (MiCS / HSDP: partitions within S "
        "ranks; -1 = off)",
    "zero_optimization.zero_hpz_partition_size": "hpz_group_size (ZeRO++ hpZ, stage 3: backward's "
        "all-gather within R ranks; 1 = off)",
    "zero_optimization.leaf_module.classes": "stage 3: modules of these classes (a name or "
        "module.qualname) are leaf modules, each gathered whole as one unit (units.py; default: "
        "DeepSpeed's, Mixtral's and Qwen's sparse MoE blocks)",
    "zero_optimization.leaf_module.names": "stage 3: the modules so named are leaf modules",
    "zero_optimization.leaf_module.name_suffixes": "stage 3: modules whose names end so are leaf "
        "modules",
    "zero_optimization.offload_optimizer.pipeline_read": "accepted: the disk tier always reads the "
        "next piece while it steps one (disk.py)",
    "zero_optimization.offload_optimizer.pipeline_write": (
        "accepted: the disk tier always writes the last piece while it steps one (disk.py)"
    ),
    "zero_optimization.offload_optimizer.pin_memory": "accepted: host buffers are pinned whenever "
        "CUDA is used",
    "zero_optimization.offload_param.pin_memory": "accepted: host buffers are pinned whenever "
        "CUDA is used",
    "optimizer.type": "optimizer: AdamW, Adam (= AdamW, as in DeepSpeed, unless adam_w_mode is "
        "false), SGD",
    "optimizer.params": "lr and the optimizer's keyword arguments (Adam/AdamW weight_decay "
        "defaults to 0, as in DeepSpeed)",
    "scheduler.type": "the learning-rate schedule, stepped with the optimizer: WarmupLR, "
        "WarmupDecayLR, WarmupCosineLR, as DeepSpeed defines them (SCHEDULES below)",
    "scheduler.params": "the schedule's parameters, DeepSpeed's names and defaults "
        "(total_num_steps: the CLI's --steps when left out or \"auto\")",
    "activation_checkpointing": "the section turns on activation_checkpointing: each block "
        "recomputed in backward (in DeepSpeed the model calls deepspeed.checkpointing.checkpoint)",
    "activation_checkpointing.cpu_checkpointing": "activation_checkpointing = cpu (the blocks' "
        "inputs on the host)",
}

# Keys naming something minizero always does: true is accepted silently, false warns.
ALWAYS_ON = {
    "zero_optimization.overlap_comm": "gradient communication always overlaps backward in stages "
        "0, 2 and 3",
    "zero_optimization.contiguous_gradients": "gradients are always copied into contiguous flat "
        "buckets",
    "zero_optimization.reduce_scatter": "stages 1-3 always reduce-scatter gradients",
    "zero_optimization.allgather_partitions": "stages 1-2 always all-gather the updated partitions",
}

# Keys DeepSpeed has that minizero reads but does not implement: key -> what minizero does instead.
# A section switched off ({"enabled": false}) or a plain false needs no warning.
NOT_IMPLEMENTED = {
    "fp16.auto_cast": "inputs are not cast; the model's floating parameters and buffers are",
    "fp16.consecutive_hysteresis": "hysteresis is restored only when the scale grows (DeepSpeed's "
        "default)",
    "fp16.fp16_master_weights_and_grads": "master weights are always fp32",
    "amp": "no apex AMP; use bf16.enabled, fp16.enabled or fp32",
    "steps_per_print": "progress is printed every steps/10 steps",
    "wall_clock_breakdown": "the CLI reports the median step time",
    "flops_profiler": "no profiler; the CLI reports memory and bytes communicated",
    "tensorboard": "no monitor; --json writes the results",
    "wandb": "no monitor; --json writes the results",
    "csv_monitor": "no monitor; --json writes the results",
    "gradient_predivide_factor": "gradients are averaged with one AVG collective",
    "prescale_gradients": "gradients are averaged with one AVG collective",
    "communication_data_type": "gradients are communicated in the dtype they are accumulated in "
        "(data_types.grad_accum_dtype)",
    "zero_allow_untested_optimizer": "any torch.optim optimizer works",
    "zero_force_ds_cpu_optimizer": "the host optimizer is torch.optim's",
    "zero_optimization.allgather_bucket_size": "parameters are all-gathered per reduce bucket "
        "(stages 1-2) or per unit (stage 3)",
    "zero_optimization.round_robin_gradients": "partitions are contiguous ranges",
    "zero_optimization.sub_group_size": "the optimizer steps one tensor per bucket",
    "zero_optimization.load_from_fp32_weights": "checkpoints always restore the fp32 masters",
    "zero_optimization.elastic_checkpoint": "a checkpoint loads at its own world size; python -m "
        "minizero.consolidate for another",
    "zero_optimization.ignore_unused_parameters": "unused parameters get zero gradients",
    "zero_optimization.stage3_max_live_parameters": "units in flight: the current one and one "
        "prefetched",
    "zero_optimization.stage3_max_reuse_distance": "units are freed right after use",
    "zero_optimization.stage3_param_persistence_threshold": "every unit is sharded, however small",
    "zero_optimization.memory_efficient_linear": "torch.nn.functional.linear is never replaced "
        "(DeepSpeed's stage 3 swaps in its own, process-wide)",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "use engine.full_state_dict()",
    "zero_optimization.mics_hierarchical_params_gather": "parameters are all-gathered within the "
        "shard group in one step",
    "zero_optimization.offload_optimizer.buffer_count": "one host buffer per bucket",
    "zero_optimization.offload_optimizer.fast_init": "the host optimizer is built the ordinary way",
    "zero_optimization.offload_param.buffer_count": "one device buffer per gathered unit",
    "zero_optimization.offload_param.buffer_size": "one device buffer per gathered unit",
    "zero_optimization.offload_param.max_in_cpu": "every parameter shard stays on the host",
    "activation_checkpointing.partition_activations": "P_a splits the checkpoints that model "
        "parallelism replicates over its ranks; in pure data parallelism each rank's activations "
        "are its own rows: kept whole (cpu_checkpointing applies)",
    "activation_checkpointing.contiguous_memory_optimization": "it packs P_a's partitions into "
        "one buffer: no partitions, checkpoints stay separate tensors",
    "activation_checkpointing.number_checkpoints": "one checkpoint per block",
    "activation_checkpointing.synchronize_checkpoint_boundary": "no device synchronization at "
        "checkpoints",
    "activation_checkpointing.profile": "no per-checkpoint timing; the CLI reports the step time",
}

# What each optimizer.type takes, and of which type ("number", "bool", "betas").
_ADAM = {"lr": "number", "betas": "betas", "eps": "number", "weight_decay": "number",
         "amsgrad": "bool", "adam_w_mode": "bool", "torch_adam": "bool"}
OPTIMIZER_PARAMS = {
    "adam": _ADAM, "adamw": _ADAM,
    "sgd": {"lr": "number", "momentum": "number", "dampening": "number", "weight_decay": "number",
            "nesterov": "bool"},
}

_SECTIONS = {"bf16", "fp16", "data_types", "zero_optimization", "zero_optimization.leaf_module",
             "zero_optimization.offload_optimizer", "zero_optimization.offload_param", "optimizer",
             "optimizer.params", "activation_checkpointing", "scheduler", "scheduler.params"}
AUTO = "auto"
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# "auto" sizes Hugging Face's DeepSpeed integration derives from the model's hidden size h
# (transformers/integrations/deepspeed.py): elements.
_FROM_HIDDEN_SIZE = {"zero_optimization.reduce_bucket_size": lambda h: h * h,
                     "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
                     "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h}


def load_deepspeed_config(source: str | os.PathLike | dict, world_size: int, *, flags: bool = True,
                          hidden_size: int | None = None) -> tuple[dict, list[str]]:
    """(TrainConfig field overrides, warnings) for a DeepSpeed-style config file or dict.

    flags: "auto" values are left to the command line's flags and minizero's defaults (the CLI).
    False (minizero.initialize): resolved by the batch rule or from `hidden_size`, else a
    ConfigError."""
    raw = source if isinstance(source, dict) else _read(source)
    if not isinstance(raw, dict):
        raise ConfigError("the config must be a JSON object")
    flat = _flatten(raw)
    for key in flat:
        if key not in KEYS and key not in ALWAYS_ON and key not in NOT_IMPLEMENTED \
                and not key.startswith(("optimizer.params.", "scheduler.params.")):
            raise ConfigError(f"unknown key '{key}'" + _did_you_mean(key))
    autos = [k for k, v in flat.items() if v == AUTO]
    flat = {k: v for k, v in flat.items() if v != AUTO}
    if not flags:
        _resolve_auto(autos, flat, hidden_size)
    warnings = [f"'{key}' is not implemented: {NOT_IMPLEMENTED[key]}" for key in flat
                if key in NOT_IMPLEMENTED and not _disabled(flat[key])]
    out: dict[str, Any] = {}
    _batch(flat, world_size, out)
    # DeepSpeed clips at 1.0 when the file says nothing (GRADIENT_CLIPPING_DEFAULT): the same file
    # must train the same way here.
    clip = _number("gradient_clipping", flat.get("gradient_clipping", 1.0), minimum=0)
    out["clip_grad_norm"] = clip or None
    if "stall_timeout" in flat:
        out["stall_timeout"] = _number("stall_timeout", flat["stall_timeout"], minimum=0) or None
    _precision(flat, out)
    _zero(flat, out, warnings, world_size)
    _optimizer(flat, out)
    _scheduler(flat, out, required=() if flags else ("total_num_steps",))
    if "activation_checkpointing" in raw:
        key = "activation_checkpointing.cpu_checkpointing"
        out["activation_checkpointing"] = "cpu" if _bool(key, flat.get(key, False)) else True
    return out, warnings


# ------------------------------------------------------------------------------------------------

def _resolve_auto(autos: list[str], flat: dict, hidden_size: int | None) -> None:
    """minizero.initialize's "auto": a batch size the other two determine (DeepSpeed's rule, applied
    by _batch), a size Hugging Face derives from the hidden size; anything else has no one to decide
    it."""
    for key in autos:
        if key in _BATCH_KEYS:
            if any(other not in flat for other in _BATCH_KEYS if other != key):
                raise ConfigError(f"{key} is \"auto\": it is resolved only when the other two of "
                                  f"{', '.join(_BATCH_KEYS)} are given")
        elif key in _FROM_HIDDEN_SIZE:
            if hidden_size is None:
                raise ConfigError(f"{key} is \"auto\", which needs the model's hidden size "
                                  "(model.config.hidden_size): give a number")
            flat[key] = _FROM_HIDDEN_SIZE[key](hidden_size)
        else:
            raise ConfigError(f"{key} is \"auto\": Hugging Face's Trainer fills it in; "
                              "minizero.initialize needs a value")


def _read(path) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} "
                          f"column {e.colno}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; sections minizero knows are opened, other values kept
    whole."""
    out = {}
    for key, value in d.items():
        path = f"{prefix}{key}"
        if path in _SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"'{path}' must be an object, got {json.dumps(value)}")
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _disabled(value: Any) -> bool:
    """{"enabled": false} or a plain false; "enabled": "auto" too, since nothing in minizero enables
    it."""
    return value is False or isinstance(value, dict) and value.get("enabled") in (False, AUTO)


def _did_you_mean(key: str) -> str:
    known = list(KEYS) + list(ALWAYS_ON) + list(NOT_IMPLEMENTED) + sorted(_SECTIONS)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    if close:
        return f" (did you mean '{close[0]}'?)"
    return " (see docs/deepspeed_config.md for the supported keys)"


def _int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer, got {json.dumps(value)}")
    if value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value}")
    return value


def _number(key: str, value: Any, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ConfigError(f"{key} must be a number >= {minimum:g}, got {json.dumps(value)}")
    return value


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {json.dumps(value)}")
    return value


def _device(key: str, flat: dict, allowed: tuple[str, ...] = ("cpu", "none")) -> str:
    value = flat.get(key, "none")
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(map(json.dumps, allowed))}, "
                          f"got {json.dumps(value)}")
    return value


def _batch(flat: dict, world_size: int, out: dict) -> None:
    """DeepSpeed's rule: train_batch_size = micro x accumulation x world size (N)."""
    total, micro, accum = (_int(key, flat[key], minimum=1) if key in flat else None
                           for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                       "gradient_accumulation_steps"))
    if total is None and micro is None:
        if accum is not None:
            raise ConfigError("gradient_accumulation_steps needs train_batch_size or "
                              "train_micro_batch_size_per_gpu")
        return
    if total is None:
        accum = accum or 1
        total = micro * accum * world_size
    elif micro is None:
        accum = accum or 1
        if total % (accum * world_size):
            raise ConfigError(f"train_batch_size {total} is not divisible by "
                              f"gradient_accumulation_steps x world size = {accum} x {world_size}")
    elif accum is None:
        if total % (micro * world_size):
            raise ConfigError(f"train_batch_size {total} is not divisible by "
                              f"train_micro_batch_size_per_gpu x world size = {micro} x "
                              f"{world_size}")
        accum = total // (micro * world_size)
    if micro is not None and total != micro * accum * world_size:
        raise ConfigError(f"train_batch_size {total} != train_micro_batch_size_per_gpu x "
                          f"gradient_accumulation_steps x world size = {micro} x {accum} x "
                          f"{world_size}")
    out["batch_size"], out["grad_accum"] = total, accum


def _precision(flat: dict, out: dict) -> None:
    """bf16.enabled, fp16.enabled (one of them), data_types.grad_accum_dtype and fp16's loss
    scaling."""
    bf16, fp16 = (_bool(key, flat[key]) if key in flat else None
                  for key in ("bf16.enabled", "fp16.enabled"))
    if bf16 and fp16:
        raise ConfigError("bf16.enabled and fp16.enabled are both true: choose one precision")
    if bf16 is not None or fp16 is not None:
        out["dtype"] = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    key = "data_types.grad_accum_dtype"
    if key in flat:
        dtype, value = out.get("dtype", "fp32"), flat[key]
        try:
            check(0, dtype, reduce_dtype=value)                  # the engines' own rule
        except ValueError:
            raise ConfigError(f"{key} must be \"fp32\" or the training precision \"{dtype}\", "
                              f"got {json.dumps(value)}") from None
        if value != dtype:                               # the compute dtype: nothing to change
            out["reduce_dtype"] = value
    if not fp16:
        return
    static = _number("fp16.loss_scale", flat.get("fp16.loss_scale", 0), minimum=0)
    dynamic = {key: _int(f"fp16.{key}", flat[f"fp16.{key}"],
                         minimum=0 if key == "initial_scale_power" else 1)
               for key in DYNAMIC_DEFAULTS if f"fp16.{key}" in flat}
    out["loss_scale"] = float(static) if static else (dynamic or None)   # 0: dynamic, as DeepSpeed


def _groups(flat: dict, out: dict, world_size: int) -> None:
    """MiCS's shard size (-1: off) and ZeRO++ hpZ's partition size (1: off), checked by wrap's
    rules."""
    for key, name, off in (("zero_optimization.mics_shard_size", "shard_group_size", -1),
                           ("zero_optimization.zero_hpz_partition_size", "hpz_group_size", 1)):
        if key in flat and _int(key, flat[key], minimum=-1) != off:
            out[name] = flat[key]
    # without a stage here the CLI checks them
    if "stage" in out and ("shard_group_size" in out or "hpz_group_size" in out):
        try:
            check(out["stage"], shard_group_size=out.get("shard_group_size"),
                  hpz_group_size=out.get("hpz_group_size"), world_size=world_size)
        except ValueError as e:
            raise ConfigError(f"zero_optimization: {e}") from None


def _zero(flat: dict, out: dict, warnings: list[str], world_size: int) -> None:
    """zero_optimization: stage, offload, bucket sizes, prefetch; warnings for what minizero does
    not do."""
    stage = flat.get("zero_optimization.stage")
    offload = {"cpu": "optimizer", "nvme": "disk", "none": False}[_device(
        "zero_optimization.offload_optimizer.device", flat, ("cpu", "nvme", "none"))]
    if offload == "disk":
        key = "zero_optimization.offload_optimizer.nvme_path"
        if key not in flat:
            raise ConfigError(f"{key} is needed with device \"nvme\": the disk tier's folder")
        out["offload_path"] = flat[key]
    if _device("zero_optimization.offload_param.device", flat) == "cpu":
        offload = "params"
    if stage is not None:
        try:
            # wrap's own rules
            check(_int("zero_optimization.stage", stage, minimum=0), offload=offload,
                  offload_path=out.get("offload_path"))
        except ValueError as e:
            raise ConfigError(f"zero_optimization.stage {stage}: {e}") from None
        out["stage"] = stage
    if offload:
        out["offload"] = offload
    key = "zero_optimization.reduce_bucket_size"
    if key in flat:
        elements = _number(key, flat[key], minimum=1)
        # DeepSpeed counts elements, minizero bytes
        out["bucket_size"] = elements * element_bytes(out.get("dtype", "fp32"))
        if stage in (1, 3):
            instead = ("one flat gradient buffer is reduce-scattered at the step" if stage == 1
                       else "each unit's gradients form one bucket")
            warnings.append(f"'{key}' has no effect at stage {stage}: {instead}")
    key = "zero_optimization.stage3_prefetch_bucket_size"
    if key in flat:
        out["prefetch"] = _number(key, flat[key], minimum=0) > 0
    # the CLI checks the stage (wrap.check_options)
    for option in ("quantized_weights", "quantized_gradients"):
        key = f"zero_optimization.zero_{option}"
        if key in flat:
            out[option] = _bool(key, flat[key])
    _groups(flat, out, world_size)
    leaves = {}
    for field in ("classes", "names", "name_suffixes"):     # a string is a list of one: DeepSpeed
        key = f"zero_optimization.leaf_module.{field}"
        if key in flat:
            value = [flat[key]] if isinstance(flat[key], str) else flat[key]
            if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise ConfigError(f"{key} must be a list of strings, got {json.dumps(value)}")
            leaves[field] = value
    if leaves:
        out["leaf_module"] = leaves
    for key, instead in ALWAYS_ON.items():
        if key in flat and not _bool(key, flat[key]):
            warnings.append(f"'{key}: false' is not implemented: {instead}")
    if flat.get("zero_optimization.overlap_comm") is True and stage == 1:
        warnings.append("'zero_optimization.overlap_comm' is not implemented at stage 1: it "
                        "reduce-scatters once, at the step (stage 2 overlaps)")


def _typed_section(flat: dict, section: str) -> tuple[Any, dict] | None:
    """(type, params) of a section DeepSpeed writes as {"type", "params"} (optimizer, scheduler);
    None when the file has none."""
    prefix = f"{section}.params."
    params = {k.removeprefix(prefix): v for k, v in flat.items() if k.startswith(prefix)}
    if f"{section}.type" not in flat:
        if params:
            raise ConfigError(f"{section}.params needs {section}.type")
        return None
    return flat[f"{section}.type"], params


def _check_params(section: str, kind: str, params: dict, types: dict) -> None:
    """Each of a section's params is one `kind` takes, of its type: "number" (>= 0), "int" (>= 1),
    "bool", "betas" (two numbers) or a tuple of the values allowed."""
    for key, value in params.items():
        where = f"{section}.params.{key}"
        if key not in types:
            raise ConfigError(f"{where} is not a parameter of {kind} "
                              f"(it takes {', '.join(sorted(types))})")
        if types[key] == "number":
            _number(where, value, minimum=0)
        elif types[key] == "int":
            _int(where, value, minimum=1)
        elif types[key] == "bool":
            _bool(where, value)
        elif isinstance(types[key], tuple):
            if value not in types[key]:
                raise ConfigError(f"{where} must be one of {', '.join(types[key])}, "
                                  f"got {json.dumps(value)}")
        elif not (isinstance(value, list) and len(value) == 2
                  and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in value)):
            raise ConfigError(f"{where} must be a list of two numbers, got {json.dumps(value)}")


def _optimizer(flat: dict, out: dict) -> None:
    section = _typed_section(flat, "optimizer")
    if section is None:
        return
    kind, params = section
    if not isinstance(kind, str) or kind.lower() not in OPTIMIZER_PARAMS:
        raise ConfigError(f"optimizer.type must be one of AdamW, Adam, SGD, got {json.dumps(kind)}")
    name = kind.lower()
    _check_params("optimizer", kind, params, OPTIMIZER_PARAMS[name])
    if name != "sgd":
        # DeepSpeed's "Adam" decouples weight decay (AdamW) unless adam_w_mode is false, and its
        # Adam optimizers default to weight_decay 0 (torch.optim.AdamW's default is 0.01).
        if name == "adam" and params.get("adam_w_mode", True):
            name = "adamw"
        params.pop("adam_w_mode", None)
        params.pop("torch_adam", None)                 # minizero always steps with torch.optim
        params.setdefault("weight_decay", 0.0)
        if "betas" in params:
            params["betas"] = tuple(params["betas"])
    lr = params.pop("lr", None)
    if lr is not None and lr <= 0:
        raise ConfigError(f"optimizer.params.lr must be > 0, got {lr}")
    try:                                  # torch's own checks (betas in [0, 1), nesterov...), now
        OPTIMIZERS[name]([torch.zeros(1, requires_grad=True)], lr=lr or 1e-3, **params)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"optimizer.params rejected by torch.optim.{OPTIMIZERS[name].__name__}: "
                          f"{e}") from None
    out["optimizer"] = name
    if lr is not None:
        out["lr"] = lr
    out["optimizer_params"] = params


def _scheduler(flat: dict, out: dict, required: tuple[str, ...]) -> None:
    """scheduler: one of SCHEDULES and its parameters (required: those minizero.initialize has no
    --steps for)."""
    section = _typed_section(flat, "scheduler")
    if section is None:
        return
    kind, params = section
    if kind not in SCHEDULES:
        raise ConfigError(f"scheduler.type must be one of {', '.join(SCHEDULES)} (DeepSpeed's "
                          f"warmup schedules), got {json.dumps(kind)}")
    takes = SCHEDULES[kind].PARAMS
    _check_params("scheduler", kind, params, takes)
    for key in required:
        if key in takes and key not in params:
            raise ConfigError(f"scheduler.params.{key} is required by {kind}")
    out["scheduler"] = {"type": kind, "params": params}


def build_scheduler(optimizer: torch.optim.Optimizer, spec: dict,
                    total_num_steps: int | None = None):
    """The schedule `spec` ({"type", "params"}: the reader's "scheduler") over `optimizer`, which it
    sets the learning rate of at once; total_num_steps: the default for schedules that need it (the
    CLI's --steps)."""
    cls, params = SCHEDULES[spec["type"]], dict(spec["params"])
    if "total_num_steps" in cls.PARAMS:
        params.setdefault("total_num_steps", total_num_steps)
        if params["total_num_steps"] is None:
            raise ConfigError(f"scheduler.params.total_num_steps is required by {spec['type']}")
    return cls(optimizer, **params)


# --- DeepSpeed's learning-rate schedules (deepspeed/runtime/lr_schedules.py, 0.19.8) -------------

class WarmupLR:
    """lr = min + (max - min)·γ(i) for each parameter group, i = last_batch_iteration, counting
    optimizer steps from -1. Warm-up over W = max(2, warmup_num_steps) steps: γ = log(i + 1)/log(W)
    ('log', the default) or i/W ('linear'); γ = 1 from i = W on. Built at i = -1, it sets lr = min
    at once (so the first optimizer step runs at warmup_min_lr); step() after each optimizer step.
    warmup_max_lr left out: each group's own lr."""
    PARAMS: ClassVar[dict] = {"warmup_min_lr": "number", "warmup_max_lr": "number",
                              "warmup_num_steps": "int", "warmup_type": ("log", "linear")}
    default_max_lr: float | None = None

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log"):
        self.optimizer = optimizer
        top = self.default_max_lr if warmup_max_lr is None else warmup_max_lr
        groups = optimizer.param_groups
        self.min_lrs = [warmup_min_lr] * len(groups)
        self.max_lrs = [g["lr"] if top is None else top for g in groups]
        self.warmup_num_steps, self.warmup_type = max(2, warmup_num_steps), warmup_type
        self.last_batch_iteration = -1
        self._apply()

    def warmup(self) -> float:
        i, w = self.last_batch_iteration, self.warmup_num_steps
        return math.log(i + 1) / math.log(w) if self.warmup_type == "log" else i / w

    def gamma(self) -> float:
        return self.warmup() if self.last_batch_iteration < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        return [lo + (hi - lo) * self.gamma() for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def step(self) -> None:
        self.last_batch_iteration += 1
        self._apply()

    def _apply(self) -> None:
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]
        self._apply()


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then γ falls linearly to 0 at total_num_steps: γ = (T - i)/max(1, T - W). Unlike
    WarmupLR, DeepSpeed's warmup_max_lr defaults to 0.001 here."""
    PARAMS: ClassVar[dict] = {**WarmupLR.PARAMS, "total_num_steps": "int"}
    default_max_lr = 0.001

    def __init__(self, optimizer, total_num_steps: int, **params):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, **params)

    def gamma(self) -> float:
        i, w, t = self.last_batch_iteration, self.warmup_num_steps, self.total_num_steps
        return self.warmup() if i < w else max(0.0, (t - i) / max(1.0, t - w))


class WarmupCosineLR(WarmupLR):
    """Ratios of each group's own lr: warm-up from warmup_min_ratio to 1 (as WarmupLR's γ), then a
    cosine from 1 down to cos_min_ratio at total_num_steps, held there after; lr = 0 before the
    first step."""
    PARAMS: ClassVar[dict] = {"total_num_steps": "int", "warmup_min_ratio": "number",
                              "warmup_num_steps": "int", "cos_min_ratio": "number",
                              "warmup_type": ("log", "linear")}

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log"):
        self.total_num_steps, self.warmup_min_ratio, self.cos_min_ratio = \
            total_num_steps, warmup_min_ratio, cos_min_ratio
        super().__init__(optimizer, 0.0, None, warmup_num_steps, warmup_type)

    def get_lr(self) -> list[float]:
        i, w = self.last_batch_iteration, self.warmup_num_steps
        if i < 0:
            ratio = 0.0
        elif i < w:
            ratio = self.warmup_min_ratio + self.warmup() * (1 - self.warmup_min_ratio)
        else:
            progress = min(1.0, (i - w + 1) / max(1, self.total_num_steps - w))
            cosine = (1 + math.cos(math.pi * progress)) / 2
            ratio = max(0.0, self.cos_min_ratio + (1 - self.cos_min_ratio) * cosine)
        return [lr * ratio for lr in self.max_lrs]


SCHEDULES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR)}
