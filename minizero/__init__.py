"""minizero: data-parallel training with ZeRO, small enough to read in an afternoon.

    import functools, torch, minizero
    engine = minizero.wrap(model, stage=2, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    engine, optimizer, _, scheduler = minizero.initialize(model=model, config="ds.json") # DeepSpeed
    model = minizero.FullyShardedDataParallel(model)     # FairScale's: you build the optimizer
    model = minizero.DistributedDataParallel(model)      # PyTorch's DDP: your optimizer, your loop
    optimizer = minizero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    results = minizero.launch(worker_fn, world_size=4)   # run a function on 4 ranks
    with minizero.sharded_init(): model = MyModel()      # stage 3: built partitioned, never whole
    minizero.set_z3_leaf_modules(model, [MoEBlock])      # stage 3: gathered whole (DeepSpeed's)

This folder is the ZeRO implementation, read in this order (3,131 lines, docstrings included):
    comm.py (691) -> events.py (116) -> flat.py (237) -> reducer.py (126) -> optim.py (324)
    -> engine.py (535) -> stages.py (78, the paper's table: one row per stage) -> ddp.py (126)
    -> zero1.py (77) -> zero2.py (115) -> zero3.py (350, with units.py 287, leaf modules included)
    -> offload.py (69).
Then the stage helpers beside it: options.py (which stage takes what), absent.py (a stage-3
parameter between uses), loss_scale.py for fp16, owners.py (one engine per parameter),
checkpoint.py, memory/ (the paper's formulas and the byte counter), and the public entry points
wrap.py, launcher.py and construct.py, which holds sharded_init.
The folders around it plug into it, each named for what it is:
    deepspeed/   DeepSpeed's front end: initialize, its JSON config, its checkpoints' tags
    fairscale/   FairScale's FullyShardedDataParallel (flat parameters) and its wrap helpers
    pytorch/     PyTorch's DistributedDataParallel and ZeroRedundancyOptimizer (whole parameters)
    beyond/      what came after the paper: ZeRO-R's activations, ZeRO++, ZeRO-Infinity's disk tier,
                 a modelled network, desync detection, tensor parallelism on a 2-D mesh
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

__all__ = ["DistributedDataParallel", "FullyShardedDataParallel", "ZeroRedundancyOptimizer",
           "fsdp_wrap", "get_z3_leaf_modules", "initialize", "launch",
           "set_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "sharded_init", "unset_z3_leaf_modules", "wrap", "z3_leaf_module"]
