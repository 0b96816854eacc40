"""FairScale FSDP's constructor keywords on minizero (read fairscale/fsdp.py first): each one
implemented with FairScale 0.4.13's meaning, accepted with one warning line where it changes only
speed, or refused in one line where it cannot apply.

    python -m pytest tests/test_fairscale_scenarios.py

Implemented: reshard_after_forward, disable_reshard_on_root, mixed_precision, compute_dtype (without
mixed_precision: FairScale's pure 16-bit mode, the model converted beforehand; torch.float32 with
it: fp32 compute, inputs cast to fp16 for autocast), buffer_dtype (the compute dtype or fp32),
fp32_reduce_scatter, allow_reset_parameters, force_input_to_fp32, state_dict_on_rank_0_only,
verbose, and process_group when it is every rank (minizero shards over all N; hybrid sharding is
minizero.wrap's shard_group_size). On a CPU, move_params_to_cpu / cpu_offload / move_grads_to_cpu
hold already. Speed only (warned): flatten_parameters=False, process_group_reduce_scatter,
bucket_cap_mb, gradient_predivide_factor, clear_autocast_cache, state_dict_device other than the
CPU.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minizero import comm

COMPUTE_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class Settings:
    """What the wrapper keeps of FairScale's keywords."""
    dtype: str                        # the engine's compute dtype ("fp32", "fp16", "bf16")
    reduce_dtype: str | None          # None: reduced in dtype; "fp32": fp32_reduce_scatter
    masters: bool                     # mixed precision: fp32 masters of 16-bit partitions
    mixed_precision: bool             # the root casts floating inputs to 16 bits
    fp32_buffers: bool                # buffer_dtype=torch.float32 under 16-bit compute
    reshard_after_forward: bool
    force_input_to_fp32: bool
    state_dict_on_rank_0_only: bool
    verbose: bool

    @property
    def engine_options(self) -> dict:
        return {"dtype": self.dtype, "reduce_dtype": self.reduce_dtype}

    def input_dtype(self, root: bool) -> torch.dtype | None:
        """What floating inputs are cast to (FairScale's forward): the compute dtype at the root of
        a mixed-precision model, fp32 anywhere with force_input_to_fp32; else None."""
        if self.mixed_precision:          # FairScale's: to fp16 (here: the 16-bit compute dtype)
            return (torch.float16 if self.dtype == "fp32" else self.torch_dtype) if root else None
        return torch.float32 if self.force_input_to_fp32 else None

    @property
    def torch_dtype(self) -> torch.dtype:
        return {v: k for k, v in COMPUTE_DTYPES.items()}[self.dtype]

    def check_pure(self, module) -> None:
        """FairScale's pure 16-bit mode (a 16-bit compute_dtype without mixed_precision): the model
        is in that dtype already, and so are the FlatParameters (no fp32 masters)."""
        if self.dtype != "fp32" and not self.mixed_precision and any(
                p.dtype != self.torch_dtype for p in module.parameters()):
            raise ValueError(f"compute_dtype={self.torch_dtype} without mixed_precision is pure "
                             f"16-bit mode: convert the model first (model.to({self.torch_dtype}))"
                             ", or pass mixed_precision=True")

    def describe(self) -> str:                         # verbose=True: the module's repr says
        return (f"compute_dtype={self.dtype}, reduce_dtype={self.reduce_dtype or self.dtype}, "
                f"reshard_after_forward={self.reshard_after_forward}")


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _speed_only(name: str, why: str) -> None:
    warnings.warn(f"FullyShardedDataParallel: {name} has no effect here: {why}", stacklevel=4)


def resolve(process_group, process_group_reduce_scatter, reshard_after_forward,
            disable_reshard_on_root, mixed_precision, fp32_reduce_scatter, flatten_parameters,
            move_params_to_cpu, compute_dtype, buffer_dtype, move_grads_to_cpu, bucket_cap_mb,
            compute_device, no_broadcast_optim_state, state_dict_device, clear_autocast_cache,
            force_input_to_fp32, verbose, cpu_offload, state_dict_on_rank_0_only,
            gradient_predivide_factor, allow_reset_parameters) -> Settings:
    """FullyShardedDataParallel's arguments (FairScale's names and order) -> Settings, or one
    line."""
    if isinstance(process_group, bool):
        raise TypeError("FullyShardedDataParallel's second argument is FairScale's process_group; "
                        "pass reshard_after_forward= by keyword")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed process group or None, got "
                        f"{type(process_group).__name__}")
    if process_group is not None and dist.get_world_size(process_group) != comm.world_size():
        raise ValueError("process_group must be None or every rank: minizero's FSDP shards over "
                         "all N (hybrid sharding: minizero.wrap(..., shard_group_size=S))")
    for name in ("reshard_after_forward", "disable_reshard_on_root", "mixed_precision",
                 "fp32_reduce_scatter", "flatten_parameters", "force_input_to_fp32", "verbose",
                 "state_dict_on_rank_0_only", "no_broadcast_optim_state",
                 "allow_reset_parameters"):
        _flag(name, locals()[name])
    if not flatten_parameters:
        _speed_only("flatten_parameters=False", "each unit is one flat bucket (flat.py), one "
                    "FlatParameter; the training is the same")
    if compute_dtype is not None and compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be torch.float32, float16 or bfloat16, got "
                         f"{compute_dtype!r}")
    dtype = COMPUTE_DTYPES[compute_dtype or (torch.float16 if mixed_precision else torch.float32)]
    if buffer_dtype is not None and COMPUTE_DTYPES.get(buffer_dtype) not in (dtype, "fp32"):
        raise ValueError(f"buffer_dtype must be the compute dtype ({dtype}) or torch.float32, got "
                         f"{buffer_dtype!r}")
    if fp32_reduce_scatter and not mixed_precision:
        raise ValueError("fp32_reduce_scatter requires mixed_precision=True")      # as FairScale
    on_cpu = comm.device().type == "cpu"
    for name in ("move_params_to_cpu", "cpu_offload", "move_grads_to_cpu"):
        if locals()[name] and not on_cpu:
            raise ValueError(f"{name}=True is not supported on {comm.device()}: offload with "
                             "minizero.wrap(model, 3, ..., offload='params' or True)")
    if compute_device is not None and torch.device(compute_device).type != comm.device().type:
        raise ValueError(f"compute_device must be this rank's device ({comm.device()}), got "
                         f"{compute_device!r}")
    if no_broadcast_optim_state:
        raise ValueError("no_broadcast_optim_state=True is for FSDP instances with their own "
                         "process group (mixture of experts), which minizero does not have")
    if process_group_reduce_scatter is not None:
        _speed_only("process_group_reduce_scatter", "gradients are reduce-scattered on the "
                    "process group, overlapped with backward by async collectives")
    if bucket_cap_mb != 25:
        _speed_only("bucket_cap_mb", "each unit's gradients are reduce-scattered as one bucket")
    if gradient_predivide_factor is not None:
        _speed_only("gradient_predivide_factor", "gradients are averaged once, after the sum")
    if clear_autocast_cache:
        _speed_only("clear_autocast_cache", "minizero's mixed precision does not use autocast")
    if state_dict_device is not None and torch.device(state_dict_device).type != "cpu":
        _speed_only("state_dict_device", "state_dict() returns CPU tensors")
    return Settings(dtype, "fp32" if fp32_reduce_scatter else None,
                    mixed_precision and dtype != "fp32", mixed_precision,
                    dtype != "fp32" and buffer_dtype == torch.float32, reshard_after_forward,
                    force_input_to_fp32, state_dict_on_rank_0_only, verbose)
