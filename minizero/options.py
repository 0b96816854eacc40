"""What each stage takes, and the checks of option values: one home for each rule.

    python -m pytest tests/test_engine.py tests/test_cli.py

`minizero.wrap`, the engines' own checks, `minizero.memory`, the training loop (lab/train.py), the
CLI and the DeepSpeed-config reader all ask this table, so a rule ("offload needs stage 1-3", "hpZ
needs stage 3") is written once. The table follows the paper: each stage partitions one more kind
of model state (P_os, P_os+g, P_os+g+p), and what an option changes exists only from the stage that
has it. The engine's policies live here too: Options (what the families read), Precision,
Offload and Sharding (the process groups it makes: ProcessGroups), each frozen, each checking its
own rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minizero import comm
from minizero.beyond import disk
from minizero.beyond.mesh import mesh, row_group
from minizero.beyond.quantize import BLOCK
from minizero.engine import StageOptions
from minizero.optim import DTYPES

STAGES = (0, 1, 2, 3)                          # 0 = DDP; minizero.wrap has one engine per stage


@dataclass(frozen=True)
class Capabilities:
    partitions: tuple[str, ...]            # the model states it partitions over N (the paper's P_*)
    offload: tuple                         # what offload= may be
    options: frozenset[str]                # the options it takes beyond COMMON_OPTIONS


COMMON_OPTIONS = frozenset({"dtype", "reduce_dtype", "loss_scale", "clip_grad_norm",
                            "tensor_parallel"})
# ZeRO++ qgZ (beyond/quantize.py)
_QUANTIZED = frozenset({"quantized_gradients", "quantization_block"})
_HOST = (False, True, "optimizer", "disk")    # the optimizer's state in host memory (offload.py) or
                                              # in a file (beyond/disk.py, ZeRO-Infinity's disk
                                              # tier)

CAPABILITIES = {
    0: Capabilities((), (False,), frozenset({"bucket_size", "overlap", "buckets_in_flight"})),
    1: Capabilities(("optimizer",), _HOST, frozenset({"shard_group_size"})),
    2: Capabilities(("optimizer", "gradients"), _HOST,
                    frozenset({"bucket_size", "buckets_in_flight", "shard_group_size"})
                    | _QUANTIZED),
    3: Capabilities(("optimizer", "gradients", "parameters"), _HOST + ("params",),
                    frozenset({"units", "prefetch", "buckets_in_flight", "shard_group_size",
                               "hpz_group_size", "quantized_weights"}) | _QUANTIZED),
}


@dataclass(frozen=True)
class Options(StageOptions):
    """The options the families of wrap's engines read, with their defaults: the paper's
    (engine.StageOptions) and ZeRO++'s (what each means: wrap's docstring; which stage takes which:
    CAPABILITIES)."""
    quantized_weights: bool = False            # stage 3: ZeRO++ qwZ (beyond/quantize.py)
    quantized_gradients: bool = False          # stages 2-3: ZeRO++ qgZ
    quantization_block: int = BLOCK            # elements per fp32 scale


# --- the engine's three policies, frozen: wrap, initialize, FSDP, the CLI and the config reader ---
# --- reach them through assembled.Assembled.check (wrap.check), the engine holds them ---------
@dataclass(frozen=True)
class Precision:
    """Mixed precision (FSDP2's MixedPrecisionPolicy): `dtype` the model computes in (fp32 masters:
    optim.py), `reduce_dtype` the gradients are reduced and accumulated in (None: dtype;
    flat.FlatLayout.point_grads_into), fp16's `loss_scale` (loss_scale.py checks it)."""
    dtype: str = "fp32"
    reduce_dtype: str | None = None
    loss_scale: float | dict | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        # Reducing in more precision than the compute is the point; in less (fp32 compute, bf16
        # reduce) it would be gradient compression, which minizero does not do. The compute
        # dtype itself is a no-op.
        if self.reduce_dtype not in (None, "fp32", self.dtype):
            raise ValueError(f"reduce_dtype must be None, 'fp32' or the compute dtype "
                             f"{self.dtype!r}, got {self.reduce_dtype!r}")

    @property
    def compute(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def grads(self) -> torch.dtype:
        return DTYPES[self.reduce_dtype or self.dtype]


@dataclass(frozen=True)
class Offload:
    """Where P_os lives (FSDP2's OffloadPolicy, with ZeRO-Infinity's disk tier): `where` False
    (the device), True / "optimizer" (host memory, offload.py), "params" (stage 3: the parameter
    shard too) or "disk" (a file in the folder `path`, beyond/disk.py)."""
    where: bool | str = False
    path: str | None = None

    def check(self, stage: int) -> None:
        check_offload(stage, self.where)
        if self.path is not None and self.where != "disk":
            raise ValueError("offload_path is the disk tier's folder: it needs offload='disk'")
        if self.where == "disk":
            disk.check_folder(self.path)              # missing or unwritable: before any build


@dataclass(frozen=True)
class Sharding:
    """Who a rank shards with: shard_group_size S (beyond/hierarchical.py; None: all N) and
    hpz_group_size R (beyond/hpz.py), checked against N ranks."""
    shard_group_size: int | None = None
    hpz_group_size: int | None = None

    def check(self, stage: int, world_size: int | None = None) -> None:
        n = comm.world_size() if world_size is None else world_size
        s, r = self.shard_group_size, self.hpz_group_size
        if s is not None and not takes(stage, "shard_group_size"):
            raise ValueError("shard_group_size needs ZeRO stage 1, 2 or 3 (DDP partitions nothing)")
        if r is not None and not takes(stage, "hpz_group_size"):
            raise ValueError(f"hpz_group_size needs stage 3 (stage {stage} does not gather "
                             "parameters in backward)")
        if s is not None and not (is_positive_int(s) and n % s == 0):
            raise ValueError(f"shard_group_size must be a divisor of the world size {n} "
                             f"(1 <= S <= N), got {s!r}")
        # R divides S, so that hpZ's groups of R ranks (a node) lie inside one group of S
        if r is not None and not (is_positive_int(r) and (s or n) % r == 0):
            raise ValueError(f"hpz_group_size must be a divisor of the shard group size {s or n}, "
                             f"got {r!r}")

    def process_groups(self, tp_mesh: tuple[comm.Group, comm.Group] | None) -> ProcessGroups:
        """This rank's process groups (collective: beyond/mesh.py creates them)."""
        tensor, data = (None, None) if tp_mesh is None else tp_mesh
        full = self.shard_group_size in (None, comm.world_size())
        shard, replicate = (data, None) if full else mesh(self.shard_group_size)
        hpz = None if self.hpz_group_size is None else row_group(self.hpz_group_size)
        return ProcessGroups(tensor, data, shard, replicate, hpz)


@dataclass(frozen=True)
class ProcessGroups:
    """A rank's process groups, what FSDP2's mesh info holds; None where a group is all N ranks or
    does not exist. tensor / data: the 2-D mesh (beyond/tensor_parallel.py); shard / replicate:
    beyond/hierarchical.py; hpz: beyond/hpz.py. The engine partitions over `shard`."""
    tensor: comm.Group | None
    data: comm.Group | None
    shard: comm.Group | None
    replicate: comm.Group | None
    hpz: comm.Group | None


def check_stage(stage) -> int:
    """The one check of a stage number (wrap, the CLI and the config reader use it)."""
    if isinstance(stage, bool) or stage not in CAPABILITIES:
        raise ValueError(
            f"stage must be one of {', '.join(map(str, STAGES))} (0 = DDP), got {stage!r}"
        )
    return stage


def takes(stage: int, option: str) -> bool:
    """Whether `stage` takes `option` (an option name of wrap, COMMON_OPTIONS included)."""
    return option in COMMON_OPTIONS or option in CAPABILITIES[check_stage(stage)].options


def check_options(stage: int, options) -> None:
    """Raise TypeError (one line) if `stage` does not take one of the option names in `options`."""
    unknown = sorted(name for name in options if not takes(stage, name))
    if unknown:
        takers = sorted({s for name in unknown for s in STAGES if name in CAPABILITIES[s].options})
        where = f" (only stage {' and '.join(map(str, takers))})" if takers else ""
        raise TypeError(f"stage {stage} does not take option(s) {', '.join(unknown)}{where}")


def check_offload(stage: int, offload) -> None:
    """Raise ValueError (one line) unless `offload` is something `stage` can offload."""
    choices = CAPABILITIES[check_stage(stage)].offload
    if offload in choices:
        return
    if stage == 0:
        raise ValueError("offload needs ZeRO stage 1, 2 or 3 (DDP replicates the optimizer)")
    if offload == "params":
        raise ValueError(f"offload='params' needs stage 3 (stage {stage} keeps full parameters)")
    raise ValueError(f"offload must be one of {choices} for stage {stage}, got {offload!r}")


def is_positive_int(value) -> bool:
    """An int >= 1 that is not a bool (True is an int in Python, and never meant as a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_positive_int(name: str, value, what: str = "integer") -> None:
    """Raise ValueError (one line) unless `value` is a positive int: "NAME must be a
    positive WHAT"."""
    if not is_positive_int(value):
        raise ValueError(f"{name} must be a positive {what}, got {value!r}")
