"""minizero.DistributedDataParallel's constructor keywords: torch 2.13's, each implemented or
refused in one line (docs/pytorch.md has the table), and the buckets torch would make.

    python -m pytest tests/test_pytorch_ddp.py -k refused

The wrapper itself is ddp.py; what it checks before it takes the module, and how it cuts the
gradients into buckets, is here.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

MIB = 2**20                     # torch's bucket_cap_mb counts MiB
DEFAULT_BUCKET_MB = 25          # torch's default bucket_cap_mb
# With the default cap torch's first bucket (the last layers' gradients) is small, so that its
# all-reduce starts early in backward
FIRST_BUCKET_BYTES = MIB


def check_keywords(delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision,
                   skip_all_reduce_unused_params, check_reduction, batched_grad_copy,
                   process_group, device_mesh) -> None:
    """torch's keywords that minizero does not implement: refused in one line each."""
    refused = {
        "delay_all_reduce_named_params": delay_all_reduce_named_params is not None,
        "param_to_hook_all_reduce": param_to_hook_all_reduce is not None,
        "mixed_precision": mixed_precision is not None,
        "skip_all_reduce_unused_params": bool(skip_all_reduce_unused_params),
    }
    for name, given in refused.items():
        if given:
            raise ValueError(f"DistributedDataParallel: {name} is not supported by minizero "
                             "(docs/pytorch.md); leave it at its default")
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("DistributedDataParallel: pass process_group or device_mesh, not both")
    if check_reduction:                                                   # as torch 2.13 does
        warnings.warn("DistributedDataParallel: check_reduction is deprecated (by torch) and has "
                      "no effect", FutureWarning, stacklevel=3)
    if batched_grad_copy:
        warnings.warn("DistributedDataParallel: batched_grad_copy=True has no effect here: "
                      "gradients are views of their buckets, nothing is copied", stacklevel=3)


def check_module(module: nn.Module, trainable: list) -> torch.device:
    """The one device of the trainable parameters, or one line on what minizero cannot reduce."""
    if not trainable:
        raise RuntimeError("DistributedDataParallel: no parameter of the module requires a "
                           "gradient, so there is nothing to average")
    sparse = [f"{n or 'the module'}: nn.{type(m).__name__}(sparse=True)"
              for n, m in module.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise ValueError(f"DistributedDataParallel: sparse gradients ({sparse[0]}) are not "
                         "supported by minizero")
    dtypes = sorted({str(p.dtype) for p in trainable})
    if len(dtypes) > 1:
        raise ValueError(f"DistributedDataParallel: trainable parameters of several dtypes "
                         f"({', '.join(dtypes)}): minizero reduces one flat buffer of one dtype")
    devices = {p.device for p in trainable}
    if len(devices) > 1:
        raise ValueError(f"DistributedDataParallel: parameters on several devices "
                         f"({', '.join(sorted(map(str, devices)))}): one device per process")
    return devices.pop()


def check_devices(device: torch.device, device_ids, output_device):
    """torch's rule: device_ids and output_device only for a module on one GPU."""
    if device.type == "cpu" or not device_ids:
        if device_ids or output_device:           # torch's test: output_device=0 passes
            raise ValueError(f"DistributedDataParallel: device_ids and output_device are for a "
                             f"module on one GPU; this one is on {device} (device_ids="
                             f"{device_ids}, output_device={output_device})")
        return None, None
    ids = [torch.device(device.type, d) if isinstance(d, int) else torch.device(d)
           for d in device_ids]
    if len(ids) != 1 or ids[0] != device:
        raise ValueError(f"DistributedDataParallel: device_ids must be [the module's device] "
                         f"({device}), got {device_ids}")
    return [device.index], device.index if output_device is None else output_device


def buffer_sync(broadcast_buffers: bool | None, forward_sync_buffers: bool | None):
    """(sync buffers before each forward, sync them at construction), by torch 2.13's rule:
    broadcast_buffers is deprecated (torch's FutureWarning, given here too); False also skips the
    buffers at construction, which its new name forward_sync_buffers never does."""
    if broadcast_buffers is not None:
        wins = ", which wins here" if forward_sync_buffers is not None else ""
        warnings.warn(f"DistributedDataParallel: `broadcast_buffers` is deprecated (torch 2.13); "
                      f"use `forward_sync_buffers`{wins}", FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    return broadcast_buffers is not False, broadcast_buffers is not False


def bucket_caps(bucket_cap_mb: float | None, bucket_cap_mb_list) -> list[int]:
    """Bytes per bucket, the last repeating: torch's rule (the default cap starts with a 1 MiB
    bucket; bucket_cap_mb_list gives each bucket its own)."""
    if bucket_cap_mb_list:
        return [int(mb * MIB) for mb in bucket_cap_mb_list]
    if bucket_cap_mb is None:
        return [FIRST_BUCKET_BYTES, DEFAULT_BUCKET_MB * MIB]
    if not bucket_cap_mb >= 0:
        raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be >= 0, "
                         f"got {bucket_cap_mb!r}")
    return [int(bucket_cap_mb * MIB)]


def buckets(params: list[nn.Parameter], caps: list[int]) -> list[list[nn.Parameter]]:
    """Consecutive parameters until a bucket holds at least its cap (flat.split_into_buckets' rule,
    with a cap per bucket)."""
    groups, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= caps[min(len(groups), len(caps) - 1)]:
            groups.append(current)
            current, size = [], 0
    return groups + [current] if current else groups
