"""DeepSpeed-style JSON configs: `python -m minizero.run --config ds_config.json --world-size 4`.

    {"train_batch_size": 64, "gradient_accumulation_steps": 2,
     "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}

`load_deepspeed_config(path_or_dict, world_size)` turns such a file into overrides of
`minizero.train.TrainConfig` fields, plus warnings. The policy (docs/deepspeed_config.md):
  * a key minizero implements is applied (`KEYS` below says to what);
  * a key DeepSpeed has but minizero does not implement gives one warning naming the key and what
    minizero does instead (e.g. `overlap_comm: false`: minizero always overlaps where its stage can);
  * an unknown key, a wrong type or an impossible value is an error (ConfigError, one line): a typo such
    as "zero_optimisation" must never be silently ignored.
Batch sizes follow DeepSpeed's rule train_batch_size = micro_batch x accumulation x world size: any two
determine the third, and three that disagree are an error.
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Any

from minizero.train import OPTIMIZERS


class ConfigError(ValueError):
    """A config that cannot be used, in one line naming the key."""


# Keys minizero applies, and what they become (for the docs and --help).
KEYS = {
    "train_batch_size": "batch_size (global rows per step)",
    "train_micro_batch_size_per_gpu": "rows per rank per micro-batch (determines batch_size / grad_accum)",
    "gradient_accumulation_steps": "grad_accum",
    "gradient_clipping": "clip_grad_norm (0 = off)",
    "bf16.enabled": "dtype = bf16 (fp32 master weights)",
    "zero_optimization.stage": "stage (0 = DDP)",
    "zero_optimization.offload_optimizer.device": "offload = optimizer ('cpu') or off ('none')",
    "zero_optimization.offload_param.device": "offload = params ('cpu', stage 3 only)",
    "zero_optimization.reduce_bucket_size": "bucket_size (DeepSpeed counts elements, minizero bytes)",
    "zero_optimization.stage3_prefetch_bucket_size": "prefetch (0 = off; any other size = one unit ahead)",
    "zero_optimization.overlap_comm": "true: what minizero does anyway",
    "zero_optimization.offload_optimizer.pin_memory": "accepted: host buffers are pinned whenever CUDA is used",
    "zero_optimization.offload_param.pin_memory": "accepted: host buffers are pinned whenever CUDA is used",
    "optimizer.type": "optimizer (AdamW, Adam, SGD)",
    "optimizer.params": "lr and the optimizer's keyword arguments",
}

# Keys DeepSpeed has that minizero reads but does not implement: key -> what minizero does instead.
NOT_IMPLEMENTED = {
    "fp16": "no fp16 loss scaling; use bf16.enabled or fp32",
    "scheduler": "the learning rate stays constant",
    "steps_per_print": "progress is printed every steps/10 steps",
    "wall_clock_breakdown": "the CLI reports the median step time",
    "gradient_predivide_factor": "gradients are averaged with one AVG collective",
    "prescale_gradients": "gradients are averaged with one AVG collective",
    "communication_data_type": "gradients are communicated in the compute dtype",
    "zero_allow_untested_optimizer": "any torch.optim optimizer works",
    "zero_optimization.allgather_bucket_size": "parameters are all-gathered per reduce bucket (stage 1-2) "
                                               "or per unit (stage 3)",
    "zero_optimization.contiguous_gradients": "gradients are always contiguous (flat buckets)",
    "zero_optimization.reduce_scatter": "stages 1-3 always reduce-scatter",
    "zero_optimization.round_robin_gradients": "partitions are contiguous ranges",
    "zero_optimization.sub_group_size": "the optimizer steps one tensor per bucket",
    "zero_optimization.stage3_max_live_parameters": "units in flight: the current one and one prefetched",
    "zero_optimization.stage3_max_reuse_distance": "units are freed right after use",
    "zero_optimization.stage3_param_persistence_threshold": "every unit is sharded, however small",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "use engine.full_state_dict()",
    "zero_optimization.offload_optimizer.buffer_count": "one host buffer per bucket",
}

OPTIMIZER_PARAMS = {
    "adam": {"lr", "betas", "eps", "weight_decay", "amsgrad"},
    "adamw": {"lr", "betas", "eps", "weight_decay", "amsgrad"},
    "sgd": {"lr", "momentum", "dampening", "weight_decay", "nesterov"},
}

_SECTIONS = {"bf16", "zero_optimization", "zero_optimization.offload_optimizer",
             "zero_optimization.offload_param", "optimizer"}


def load_deepspeed_config(source: str | os.PathLike | dict, world_size: int) -> tuple[dict, list[str]]:
    """(TrainConfig field overrides, warnings) for a DeepSpeed-style config file or dict."""
    raw = _read(source) if not isinstance(source, dict) else source
    if not isinstance(raw, dict):
        raise ConfigError("the config must be a JSON object")
    flat = _flatten(raw)
    warnings = [f"'{key}' is not implemented: {NOT_IMPLEMENTED[key]}" for key in flat
                if key in NOT_IMPLEMENTED and not _disabled(key, flat[key])]
    for key in flat:
        if key not in KEYS and key not in NOT_IMPLEMENTED and not key.startswith("optimizer.params."):
            raise ConfigError(f"unknown key '{key}'" + _did_you_mean(key))
    out: dict[str, Any] = {}
    _batch(flat, world_size, out)
    if "gradient_clipping" in flat:
        clip = _number("gradient_clipping", flat["gradient_clipping"], minimum=0)
        out["clip_grad_norm"] = clip or None
    if "bf16.enabled" in flat:
        out["dtype"] = "bf16" if _bool("bf16.enabled", flat["bf16.enabled"]) else "fp32"
    stage = flat.get("zero_optimization.stage")
    if stage is not None:
        if _int("zero_optimization.stage", stage) not in (0, 1, 2, 3):
            raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
        out["stage"] = stage
    offload = False
    if _device("zero_optimization.offload_optimizer.device", flat) == "cpu":
        offload = "optimizer"
    if _device("zero_optimization.offload_param.device", flat) == "cpu":
        if out.get("stage", 3) != 3:
            raise ConfigError("zero_optimization.offload_param needs zero_optimization.stage 3")
        offload = "params"
    if offload:
        out["offload"] = offload
    if "zero_optimization.reduce_bucket_size" in flat:
        elements = _number("zero_optimization.reduce_bucket_size", flat["zero_optimization.reduce_bucket_size"],
                           minimum=1)
        out["bucket_size"] = elements * (2 if out.get("dtype") == "bf16" else 4)      # elements -> bytes
    if "zero_optimization.stage3_prefetch_bucket_size" in flat:
        size = _number("zero_optimization.stage3_prefetch_bucket_size",
                       flat["zero_optimization.stage3_prefetch_bucket_size"], minimum=0)
        out["prefetch"] = size > 0
    if "zero_optimization.overlap_comm" in flat:
        if not _bool("zero_optimization.overlap_comm", flat["zero_optimization.overlap_comm"]):
            warnings.append("'zero_optimization.overlap_comm: false' is not implemented: minizero always "
                            "overlaps gradient communication with backward in stages 0, 2 and 3")
    _optimizer(flat, out)
    return out, warnings


# --------------------------------------------------------------------------------------------------------

def _read(path) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; sections minizero knows are opened, other values kept whole."""
    out = {}
    for key, value in d.items():
        path = f"{prefix}{key}"
        if path in _SECTIONS or path == "optimizer.params":
            if not isinstance(value, dict):
                raise ConfigError(f"'{path}' must be an object, got {json.dumps(value)}")
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _disabled(key: str, value: Any) -> bool:
    """A not-implemented section that is switched off ("fp16": {"enabled": false}) needs no warning."""
    return isinstance(value, dict) and value.get("enabled") is False or value is False


def _did_you_mean(key: str) -> str:
    known = list(KEYS) + list(NOT_IMPLEMENTED)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else " (see docs/deepspeed_config.md for the supported keys)"


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer, got {json.dumps(value)}")
    return value


def _number(key: str, value: Any, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ConfigError(f"{key} must be a number >= {minimum:g}, got {json.dumps(value)}")
    return value


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {json.dumps(value)}")
    return value


def _device(key: str, flat: dict) -> str:
    value = flat.get(key, "none")
    if value not in ("cpu", "none"):
        raise ConfigError(f"{key} must be \"cpu\" or \"none\", got {json.dumps(value)}"
                          + (" (NVMe offload is not implemented)" if value == "nvme" else ""))
    return value


def _batch(flat: dict, world_size: int, out: dict) -> None:
    """DeepSpeed's rule: train_batch_size = micro x accumulation x world size."""
    total = flat.get("train_batch_size")
    micro = flat.get("train_micro_batch_size_per_gpu")
    accum = flat.get("gradient_accumulation_steps")
    for key, value in (("train_batch_size", total), ("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", accum)):
        if value is not None and _int(key, value) < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
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
            raise ConfigError(f"train_batch_size {total} is not divisible by gradient_accumulation_steps x "
                              f"world size = {accum} x {world_size}")
    elif accum is None:
        if total % (micro * world_size):
            raise ConfigError(f"train_batch_size {total} is not divisible by train_micro_batch_size_per_gpu "
                              f"x world size = {micro} x {world_size}")
        accum = total // (micro * world_size)
    if micro is not None and total != micro * accum * world_size:
        raise ConfigError(f"train_batch_size {total} != train_micro_batch_size_per_gpu x "
                          f"gradient_accumulation_steps x world size = {micro} x {accum} x {world_size}")
    out["batch_size"], out["grad_accum"] = total, accum


def _optimizer(flat: dict, out: dict) -> None:
    if "optimizer.type" not in flat:
        if any(k.startswith("optimizer.params.") for k in flat):
            raise ConfigError("optimizer.params needs optimizer.type")
        return
    kind = flat["optimizer.type"]
    if not isinstance(kind, str) or kind.lower() not in OPTIMIZERS:
        raise ConfigError(f"optimizer.type must be one of AdamW, Adam, SGD, got {json.dumps(kind)}")
    kind = kind.lower()
    params = {k.removeprefix("optimizer.params."): v for k, v in flat.items()
              if k.startswith("optimizer.params.")}
    unknown = sorted(set(params) - OPTIMIZER_PARAMS[kind])
    if unknown:
        raise ConfigError(f"optimizer.params.{unknown[0]} is not a parameter of {flat['optimizer.type']} "
                          f"(it takes {', '.join(sorted(OPTIMIZER_PARAMS[kind]))})")
    out["optimizer"] = kind
    if "lr" in params:
        out["lr"] = _number("optimizer.params.lr", params.pop("lr"), minimum=0)
    if "betas" in params:
        betas = params["betas"]
        if not (isinstance(betas, list) and len(betas) == 2 and all(isinstance(b, (int, float)) for b in betas)):
            raise ConfigError(f"optimizer.params.betas must be a list of two numbers, got {json.dumps(betas)}")
        params["betas"] = tuple(betas)
    out["optimizer_params"] = params
