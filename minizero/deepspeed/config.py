"""DeepSpeed-style JSON configs, read for the CLI and for `minizero.initialize`.

    python -m minizero.run --config ds_config.json --world-size 4
    engine, optimizer, _, lr_scheduler = minizero.initialize(model=model, config="ds_config.json")

    {"train_batch_size": 64, "gradient_accumulation_steps": 2,
     "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}

`load_deepspeed_config(path_or_dict, world_size)` turns such a file into settings named as
`minizero.lab.train.TrainConfig`'s fields (stage, offload, dtype, batch_size, grad_accum, optimizer,
lr, scheduler...), plus warnings. The policy (docs/deepspeed_config.md), key by key from the one
table in minizero/deepspeed/config_keys.py:
  * a key minizero implements is applied (KEYS says to what);
  * a key DeepSpeed reads that has no effect here gives one warning naming the key and why
    (NOT_IMPLEMENTED; ALWAYS_ON keys warn only when set to false); DeepSpeed's other spellings
    (ALIASES, LEGACY_OFFLOAD) mean what they mean there;
  * an unknown key, a wrong type or an impossible value is an error (ConfigError, one line): a typo
    such as "zero_optimisation" must never be silently ignored;
  * "auto" (Hugging Face Trainer / Accelerate configs) means "not set here": for the CLI minizero's
    default or the command-line flag decides; for minizero.initialize (flags=False) it is resolved
    wherever the batch rule, the model or initialize's arguments decide it (Hugging Face's meanings,
    `_resolve_auto`), and is one ConfigError line naming what would decide the rest.
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

from minizero.deepspeed import adam
from minizero.deepspeed.config_keys import (
    ALIASES,
    ALWAYS_ON,
    KEYS,
    LEGACY_OFFLOAD,
    NOT_IMPLEMENTED,
    REFUSED,
    SECTIONS,
    known,
)
from minizero.loss_scale import DYNAMIC_DEFAULTS
from minizero.memory import element_bytes
from minizero.wrap import check

__all__ = ["ALWAYS_ON", "KEYS", "NOT_IMPLEMENTED", "ConfigError", "build_scheduler",
           "load_deepspeed_config"]

# torch's, with DeepSpeed's bias_correction switch on Adam's two (minizero/deepspeed/adam.py)
OPTIMIZERS = {"adamw": adam.AdamW, "adam": adam.Adam, "sgd": torch.optim.SGD}


class ConfigError(ValueError):
    """A config that cannot be used, in one line naming the key."""


# What each optimizer.type takes, and of which type ("number", "bool", "betas").
_ADAM = {"lr": "number", "betas": "betas", "eps": "number", "weight_decay": "number",
         "amsgrad": "bool", "adam_w_mode": "bool", "torch_adam": "bool", "bias_correction": "bool"}
OPTIMIZER_PARAMS = {
    "adam": _ADAM, "adamw": _ADAM,
    "sgd": {"lr": "number", "momentum": "number", "dampening": "number", "weight_decay": "number",
            "nesterov": "bool"},
    # Muon for the matrices, AdamW for the rest (minizero/deepspeed/muon.py)
    "muon": {"lr": "number", "muon_lr": "number", "adam_lr": "number", "momentum": "number",
             "weight_decay": "number", "betas": "betas", "eps": "number",
             "ns_method": ("gram", "standard"), "adam_w_mode": "bool", "torch_adam": "bool",
             "per_head_muon": "bool"},
}

AUTO = "auto"
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# "auto" sizes Hugging Face's DeepSpeed integration derives from the model's hidden size h
# (transformers/integrations/deepspeed.py): elements. (stage3_param_persistence_threshold's 10·h
# needs no resolving: the key has no effect here.)
_FROM_HIDDEN_SIZE = {"zero_optimization.reduce_bucket_size": lambda h: h * h,
                     "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h)}
# "auto" whose Hugging Face value is DeepSpeed's default when the key is left out (its Trainer's
# defaults: max_grad_norm 1.0, fp32, adam betas (0.9, 0.999), eps 1e-8, weight_decay 0, warm-up
# from 0).
_AS_LEFT_OUT = ("gradient_clipping", "bf16.enabled", "fp16.enabled", "optimizer.params.betas",
                "optimizer.params.eps", "optimizer.params.weight_decay",
                "scheduler.params.warmup_min_lr")
# "auto" that only a Trainer decides: what would.
_UNDECIDED = {
    "optimizer.params.lr": "the Trainer's learning_rate; give a number, or pass optimizer= with a "
        "section of \"auto\" only",
    "scheduler.params.warmup_num_steps": "the Trainer's warmup_steps",
    "scheduler.params.total_num_steps": "the Trainer's max_steps",
}
# Resolved when the schedule is built: the optimizer's lr (Hugging Face: its learning_rate).
_AT_BUILD = "scheduler.params.warmup_max_lr"


def load_deepspeed_config(source: str | os.PathLike | dict, world_size: int, *, flags: bool = True,
                          hidden_size: int | None = None,
                          client_optimizer: bool = False) -> tuple[dict, list[str]]:
    """(TrainConfig field overrides, warnings) for a DeepSpeed-style config file or dict.

    flags: "auto" values are left to the command line's flags and minizero's defaults (the CLI).
    False (minizero.initialize): resolved by the batch rule, from `hidden_size` or by
    `client_optimizer` (initialize got optimizer=), else a ConfigError."""
    raw = source if isinstance(source, dict) else _read(source)
    if not isinstance(raw, dict):
        raise ConfigError("the config must be a JSON object")
    warnings: list[str] = []
    flat = _canonical(_flatten(_legacy_sections(raw, warnings)), warnings)
    warnings[:0] = [f"'{key}' is not implemented: {NOT_IMPLEMENTED[key]}" for key in flat
                    if key in NOT_IMPLEMENTED and not _disabled(flat[key])]
    autos = [k for k, v in flat.items() if v == AUTO and k != _AT_BUILD]
    flat = {k: v for k, v in flat.items() if k not in autos}
    if not flags:
        _resolve_auto(autos, flat, hidden_size, client_optimizer, warnings)
    out: dict[str, Any] = {}
    _batch(flat, world_size, out, sizes_auto=any(k in autos for k in _BATCH_KEYS[:2]))
    # DeepSpeed clips at 1.0 when the file says nothing (GRADIENT_CLIPPING_DEFAULT): the same file
    # must train the same way here.
    clip = _number("gradient_clipping", flat.get("gradient_clipping", 1.0), minimum=0)
    out["clip_grad_norm"] = clip or None
    if flat.get("gradient_allreduce_op", "avg") != "avg":
        raise ConfigError(f"gradient_allreduce_op {json.dumps(flat['gradient_allreduce_op'])}: "
                          "minizero averages gradients (\"avg\", DeepSpeed's default) only")
    if "stall_timeout" in flat:
        out["stall_timeout"] = _number("stall_timeout", flat["stall_timeout"], minimum=0) or None
    _precision(flat, out)
    _zero(flat, out, warnings, world_size)
    _tensor_parallel(flat, out, world_size)
    _optimizer(flat, out, warnings)
    _scheduler(flat, out, required=() if flags else ("total_num_steps",))
    if "activation_checkpointing" in raw:
        key = "activation_checkpointing.cpu_checkpointing"
        out["activation_checkpointing"] = "cpu" if _bool(key, flat.get(key, False)) else True
    return out, warnings


# ------------------------------------------------------------------------------------------------

def _legacy_sections(raw: dict, warnings: list[str]) -> dict:
    """DeepSpeed's older spellings of whole sections: "bfloat16" (read only when "bf16" is absent)
    and "zero_optimization": true / false (stage 1 / 0)."""
    raw = dict(raw)
    for old, new in ALIASES.items():
        if "." in old or old not in raw:
            continue
        value = raw.pop(old)
        if new in raw:
            warnings.append(f"'{old}' is ignored: '{new}' is given (DeepSpeed reads '{old}' only "
                            f"without '{new}')")
        else:
            raw[new] = value
    if isinstance(raw.get("zero_optimization"), bool):
        raw["zero_optimization"] = {"stage": int(raw["zero_optimization"])}
    return raw


def _canonical(flat: dict, warnings: list[str]) -> dict:
    """Aliases and DeepSpeed's deprecated cpu_offload booleans read as the keys they stand for;
    refused and unknown keys are errors; a top-level key DeepSpeed does not read warns."""
    out = {}
    for key, value in flat.items():
        if key in ALIASES or key in LEGACY_OFFLOAD:
            new = ALIASES.get(key, LEGACY_OFFLOAD.get(key))
            if new in flat:
                raise ConfigError(f"'{key}' and '{new}' are both given: '{key}' is DeepSpeed's "
                                  f"other spelling of '{new}'; give one")
            if key in LEGACY_OFFLOAD:
                if not _bool(key, value):
                    continue
                value = "cpu"                       # DeepSpeed: true offloads to the host
            key = new
        elif key in REFUSED:
            raise ConfigError(f"'{key}' is refused: {REFUSED[key]}")
        elif key not in known() and not key.startswith(("optimizer.params.", "scheduler.params.")):
            hint = _did_you_mean(key)
            if "." in key or hint.startswith(" (did"):
                raise ConfigError(f"unknown key '{key}'{hint}")
            warnings.append(f"'{key}' is not a DeepSpeed 0.19.8 key: DeepSpeed ignores it, and so "
                            "does minizero")
            continue
        out[key] = value
    return out


def _resolve_auto(autos: list[str], flat: dict, hidden_size: int | None, client_optimizer: bool,
                  warnings: list[str]) -> None:
    """minizero.initialize's "auto", with Hugging Face's meanings: a batch size the others decide
    (DeepSpeed's rule, applied by _batch) or the script's micro-batches; a size from the hidden
    size; DeepSpeed's default where it is the Trainer's default too; the optimizer= given for a
    section of "auto" only. Keys without effect here need nothing. The rest: one ConfigError."""
    section = [k for k in flat if k.startswith("optimizer.")]
    if client_optimizer and all(k.startswith("optimizer.params.") for k in autos
                                if k.startswith("optimizer.")) and section == ["optimizer.type"]:
        del flat["optimizer.type"]                 # optimizer= decides, as the Trainer's would
        autos = [k for k in autos if not k.startswith("optimizer.")]
    undecided = []
    for key in autos:
        if key in NOT_IMPLEMENTED or key in _AS_LEFT_OUT:
            continue
        if key in _BATCH_KEYS:
            sizes_left = any(k in flat for k in _BATCH_KEYS[:2])
            if key != "gradient_accumulation_steps" and not sizes_left \
                    and not any(w.startswith("train_batch_size") for w in warnings):
                warnings.append("train_batch_size and train_micro_batch_size_per_gpu are \"auto\" "
                                "or left out: the script's micro-batches decide them "
                                "(engine.train_micro_batch_size_per_gpu() is None)")
        elif key in _FROM_HIDDEN_SIZE:
            if hidden_size is not None:
                flat[key] = _FROM_HIDDEN_SIZE[key](hidden_size)
            elif key.endswith("prefetch_bucket_size"):
                flat[key] = 1                      # h² > 0 whatever h is: prefetch on
            else:
                warnings.append(f"'{key}' is \"auto\" and the model has no config.hidden_size to "
                                "derive it from: minizero's default bucket is used")
        else:
            undecided.append(f"{key} ({_UNDECIDED.get(key, 'what Hugging Face Trainer fills in')})")
    if undecided:
        raise ConfigError(f"\"auto\" that nothing in minizero.initialize decides: "
                          f"{'; '.join(undecided)}")


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
        if path in SECTIONS:
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
    """The closest known key in the same section (then anywhere): its last part is compared, so
    'zero_optimization.cpu_ofload' finds 'zero_optimization.cpu_offload', not an fp16 key."""
    section, _, name = key.rpartition(".")
    names = sorted(known() | SECTIONS)
    siblings = {k.rpartition(".")[2]: k for k in names if k.rpartition(".")[0] == section}
    close = difflib.get_close_matches(name, list(siblings), n=1, cutoff=0.75)
    if close:
        return f" (did you mean '{siblings[close[0]]}'?)"
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
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


def _batch(flat: dict, world_size: int, out: dict, sizes_auto: bool = False) -> None:
    """DeepSpeed's rule: train_batch_size = micro x accumulation x world size (N). sizes_auto: the
    two sizes were "auto" (the script's micro-batches decide them), so accumulation alone is
    enough."""
    total, micro, accum = (_int(key, flat[key], minimum=1) if key in flat else None
                           for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                       "gradient_accumulation_steps"))
    if total is None and micro is None:
        if accum is not None and sizes_auto:
            out["grad_accum"] = accum
        elif accum is not None:
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
    if offload and stage == 0:
        warnings.append("'zero_optimization.offload_optimizer' has no effect at stage 0, as in "
                        "DeepSpeed: DDP's optimizer is not partitioned")
        offload = False
    key = "zero_optimization.offload_param.device"
    if _device(key, flat, ("cpu", "nvme", "none")) != "none" and stage in (0, 1, 2):
        warnings.append(f"'zero_optimization.offload_param' has no effect at stage {stage}, as in "
                        "DeepSpeed: only stage 3 partitions the parameters")
    elif _device(key, flat, ("cpu", "nvme", "none")) != "none":
        offload = "params"
        if flat[key] == "nvme":
            warnings.append(f"'{key}: nvme' offloads to host memory: minizero's disk tier holds "
                            "the optimizer only")
    key = "zero_optimization.offload_optimizer.ratio"
    if key in flat and _number(key, flat[key], minimum=0) < 1:
        warnings.append(f"'{key}' {flat[key]} is not implemented: minizero offloads the whole "
                        "optimizer or none of it")
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
        # DeepSpeed counts elements, minizero bytes. 0 (transformers' zero3 test config): one
        # bucket per parameter in the DeepSpeed it was written for (0.19.8 refuses it), and so
        # here: a bucket closes once it holds one element's bytes (flat.split_into_buckets)
        elements = max(_number(key, flat[key], minimum=0), 1)
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


def _tensor_parallel(flat: dict, out: dict, world_size: int) -> None:
    """tensor_parallel.autotp_size: M > 1 splits the model over rows of M ranks (wrap's
    tensor_parallel); 0 (DeepSpeed's default) and 1 leave it whole."""
    key = "tensor_parallel.autotp_size"
    m = _int(key, flat.get(key, 0), minimum=0)
    if m > 1 and world_size % m:
        raise ConfigError(f"'{key}' {m} does not divide the world size {world_size}")
    if m > 1:
        out["tensor_parallel"] = m


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


def _optimizer(flat: dict, out: dict, warnings: list[str]) -> None:
    section = _typed_section(flat, "optimizer")
    if section is None:
        return
    kind, params = section
    if not isinstance(kind, str) or kind.lower() not in OPTIMIZER_PARAMS:
        raise ConfigError(f"optimizer.type must be one of AdamW, Adam, SGD, Muon, got "
                          f"{json.dumps(kind)}")
    name = kind.lower()
    _check_params("optimizer", kind, params, OPTIMIZER_PARAMS[name])
    if name == "muon":
        _muon(params, out, warnings)
        return
    if name != "sgd":
        # DeepSpeed's "Adam" decouples weight decay (AdamW) unless adam_w_mode is false, and its
        # Adam optimizers default to weight_decay 0 (torch.optim.AdamW's default is 0.01).
        if name == "adam" and params.get("adam_w_mode", True):
            name = "adamw"
        params.pop("adam_w_mode", None)
        params.pop("torch_adam", None)                 # minizero always steps with torch.optim
        if params.get("bias_correction") is True:
            del params["bias_correction"]                # torch's own Adam step (deepspeed/adam.py)
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


def _muon(params: dict, out: dict, warnings: list[str]) -> None:
    """DeepSpeed's Muon: its parameters as minizero/deepspeed/muon.py reads them; what cannot take
    effect here is an error, or a warning where only the rounding differs."""
    if params.pop("per_head_muon", False):
        raise ConfigError("optimizer.params.per_head_muon is not implemented: minizero "
                          "orthogonalizes each attention matrix whole")
    if not params.pop("adam_w_mode", True):
        raise ConfigError("optimizer.params.adam_w_mode false (L2 Adam beside Muon) is not "
                          "implemented: minizero's is AdamW")
    params.pop("torch_adam", None)                 # minizero always steps with torch.optim
    if params.pop("ns_method", None) is not None:
        warnings.append("'optimizer.params.ns_method' has no effect: minizero orthogonalizes "
                        "with torch.optim.Muon's Newton-Schulz (bf16)")
    for key in ("lr", "muon_lr", "adam_lr"):
        if params.get(key, 1) <= 0:
            raise ConfigError(f"optimizer.params.{key} must be > 0, got {params[key]}")
    out["optimizer"] = "muon"
    if "lr" in params:
        out["lr"] = params.pop("lr")
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
    _check_params("scheduler", kind, {k: v for k, v in params.items()
                                      if f"scheduler.params.{k}" != _AT_BUILD or v != AUTO}, takes)
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
    if params.get("warmup_max_lr") == AUTO:               # Hugging Face: the optimizer's lr
        params["warmup_max_lr"] = optimizer.param_groups[0]["lr"]
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
