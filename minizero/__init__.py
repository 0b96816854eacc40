"""minizero: data-parallel training with ZeRO, the paper's core small enough to read in a day.

    import functools, torch, minizero
    engine = minizero.wrap(model, stage=2, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    engine, optimizer, _, scheduler = minizero.initialize(model=model, config="ds.json") # DeepSpeed
    model = minizero.FullyShardedDataParallel(model)     # FairScale's: you build the optimizer
    minizero.fully_shard(block); minizero.fully_shard(model)   # PyTorch's FSDP2: per parameter
    model = minizero.DistributedDataParallel(model)      # PyTorch's DDP: your optimizer, your loop
    optimizer = minizero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    results = minizero.launch(worker_fn, world_size=4)   # run a function on 4 ranks
    with minizero.sharded_init(): model = MyModel()      # stage 3: built partitioned, never whole
    minizero.set_z3_leaf_modules(model, [MoEBlock])      # stage 3: gathered whole (DeepSpeed's)

The paper's ZeRO is this folder's top level, read in this order (1,599 lines, docstrings
included, and they import nothing else of minizero: about 8 hours at ~200 lines an hour):
    comm.py (280) -> events.py (68) -> flat.py (190) -> reducer.py (103) -> optim.py (133)
    -> engine.py (184) -> stages.py (69, the paper's table: one row per stage) -> ddp.py (105)
    -> zero1.py (48) -> zero2.py (90) -> zero3.py (269, a unit's lifecycle) -> offload.py (60).
Then what a user needs around it, composed into the engines wrap, initialize and
FullyShardedDataParallel build by assembled.py: units.py (stage 3's units of a real model),
absent.py, options.py (which stage takes what), param_groups.py, homes.py (where P_os lives,
checkpointable), loss_scale.py for fp16, owners.py, checkpoint.py, memory/ (the paper's formulas
and the byte counter), construct.py (sharded_init), ring.py (the teaching ring all-reduce), and
the public entry points wrap.py and launcher.py. The folders around it plug into it, each named
for what it is:
    deepspeed/   DeepSpeed's front end: initialize, its JSON config, its checkpoints' tags
    fairscale/   FairScale's FullyShardedDataParallel (flat parameters) and its wrap helpers
    pytorch/     PyTorch's DistributedDataParallel, ZeroRedundancyOptimizer (whole parameters per
                 rank) and FSDP2's fully_shard (per-parameter shards)
    beyond/      what came after the paper: ZeRO-R's activations, ZeRO++ (quantize, hpz),
                 HSDP (hierarchical, mesh), ZeRO-Infinity's disk tier, a modelled network,
                 desync detection, tensor parallelism on a 2-D mesh, Muon (an optimizer that
                 needs whole matrices)
Beside it, never imported by it (tests/test_layout.py checks): lab/ (the small GPT, the data, the
training loop, the single-process reference, PyTorch's and DeepSpeed's peers, the experiments
behind the notebooks, the benchmark) and cli/ (every command: python -m minizero <command>; the
short modules run.py, bench.py, scale.py, consolidate.py and grade.py only give them their names).
"""

from minizero.construct import sharded_init
from minizero.deepspeed import initialize
from minizero.fairscale import FullyShardedDataParallel, fsdp_wrap  # fsdp_wrap: auto_wrap & co.
from minizero.launcher import launch
from minizero.pytorch import DistributedDataParallel, ZeroRedundancyOptimizer
from minizero.units import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
)
from minizero.wrap import wrap

# PyTorch's FSDP2 (minizero/pytorch/): imported on first use, as it imports torch's DTensor (~1 s
# a process here), which nothing else in minizero needs
_FULLY_SHARD = ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy",
                "OffloadPolicy")

__all__ = ["DistributedDataParallel", "FullyShardedDataParallel", "ZeroRedundancyOptimizer",
           "fsdp_wrap", "get_z3_leaf_modules", "initialize", "launch",
           "set_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "sharded_init", "unset_z3_leaf_modules", "wrap", "z3_leaf_module", *_FULLY_SHARD]


def __getattr__(name: str):
    if name in _FULLY_SHARD:
        import minizero.pytorch
        return getattr(minizero.pytorch, name)
    raise AttributeError(f"module 'minizero' has no attribute {name!r}")
