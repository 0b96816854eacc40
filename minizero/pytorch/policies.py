"""FSDP2's policies for `minizero.fully_shard`: mixed precision and offloading, small and frozen.

    from minizero.pytorch import MixedPrecisionPolicy, CPUOffloadPolicy
    fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                      reduce_dtype=torch.float32))
    fully_shard(block, offload_policy=CPUOffloadPolicy(pin_memory=False))

The same names, fields and defaults as torch.distributed.fsdp's (torch 2.13), so a script written
for PyTorch's fully_shard runs unchanged; PyTorch's own policy objects are accepted too (`resolve`).
Each policy checks its fields when it is built: a wrong value is one line naming the field.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields

import torch
import torch.distributed.fsdp as torch_fsdp


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """What dtype each of a unit's tensors has (FSDP2's module-level mixed precision).

    param_dtype          the unsharded parameters: the all-gather, forward and backward run in it
                         (None: the parameters' own dtype). The sharded parameters the optimizer
                         steps keep their own dtype: they are the master weights, no extra copy.
    reduce_dtype         the gradients' reduce-scatter (and HSDP's all-reduce), and their sum while
                         set_requires_gradient_sync(False) accumulates (None: param_dtype's).
    output_dtype         the floating outputs of the module's forward are cast to it (None: kept).
    cast_forward_inputs  cast the floating inputs of the module's forward to param_dtype.
    """
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype)
                                          and dtype.is_floating_point):
                raise TypeError(f"MixedPrecisionPolicy: {name} must be a floating torch.dtype or "
                                f"None, got {dtype!r}")
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(f"MixedPrecisionPolicy: cast_forward_inputs must be a bool, got "
                            f"{self.cast_forward_inputs!r}")

    def dtypes(self, own: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """(compute dtype, reduce dtype) of parameters whose own dtype is `own`."""
        compute = self.param_dtype if self.param_dtype is not None and own.is_floating_point \
            else own
        return compute, self.reduce_dtype or compute


_warned: list[bool] = []            # pin_memory without an accelerator: said once per process


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: the shards live on the mesh's device (the default, as FSDP2's)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """The sharded parameters, their gradients and so the optimizer's state live in host memory; a
    unit's shards are copied to the device when it is gathered (the copy into the all-gather's
    buffer), its gradient shards back to the host after the reduce-scatter, and the optimizer
    steps on the CPU. ZeRO-Offload's idea with the optimizer where the shards are.

    pin_memory: page-locked host memory, so the copies run asynchronously (a speed-up only). It
    needs an accelerator: without one the host memory *is* the device memory, both copies are
    plain copies in the same RAM, and pin_memory=True is warned about once and dropped (PyTorch's
    fully_shard raises 'Cannot access accelerator device when none is available' there).
    """
    pin_memory: bool = True

    def __post_init__(self):
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"CPUOffloadPolicy: pin_memory must be a bool, got "
                            f"{self.pin_memory!r}")

    def pinned(self) -> bool:
        """Whether to pin: pin_memory, if this machine has an accelerator to pin for."""
        if self.pin_memory and not torch.cuda.is_available():
            if not _warned:
                _warned.append(True)
                warnings.warn("CPUOffloadPolicy(pin_memory=True) has no effect without an "
                              "accelerator (host and device memory are the same RAM): the shards "
                              "are not pinned",
                              stacklevel=4)
            return False
        return self.pin_memory


def resolve(policy, ours: type, argument: str):
    """Our policy for `policy`: one of ours, or PyTorch's of the same name (its fields copied); a
    TypeError naming the argument otherwise."""
    if isinstance(policy, ours):
        return policy
    for mine in (CPUOffloadPolicy, OffloadPolicy, MixedPrecisionPolicy):   # the narrowest first
        theirs = getattr(torch_fsdp, mine.__name__)
        if issubclass(mine, ours) and isinstance(policy, theirs):
            return mine(**{f.name: getattr(policy, f.name) for f in fields(mine)})
    article = "an" if ours.__name__[0] in "AEIOU" else "a"
    raise TypeError(f"fully_shard: {argument} must be {article} {ours.__name__}, got "
                    f"{type(policy).__name__}")
