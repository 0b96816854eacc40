"""minizero: data-parallel training with ZeRO, small enough to read in an afternoon.

    import functools, torch, minizero
    engine = minizero.wrap(model, stage=2, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    engine, optimizer, _, scheduler = minizero.initialize(model=model, config="ds.json")  # DeepSpeed
    model = minizero.FullyShardedDataParallel(model)     # FairScale: you build the optimizer
    results = minizero.launch(worker_fn, world_size=4)      # run a function on 4 ranks
    with minizero.sharded_init(): model = MyModel()         # stage 3: built partitioned, never whole

This folder is the ZeRO implementation, read in this order:
    comm.py -> flat.py -> reducer.py -> optim.py -> engine.py -> ddp.py -> zero1.py -> zero2.py -> zero3.py
    (units.py) -> offload.py, then wrap.py, launcher.py and construct.py (the public API: wrap, launch,
    sharded_init), memory/ (the paper's formulas and the byte counter), activations.py (ZeRO-R),
    checkpoint.py and network.py (comm's model of a cluster network, off by default).
Beside it, never imported by it (tests/test_layout.py checks): lab/ (the small GPT, the data, the training
loop, the single-process reference, PyTorch's peers, the experiments behind the notebooks, the benchmark)
and cli/ (the commands). The short modules run.py, bench.py, scale.py, consolidate.py and grade.py only
give the commands their names: python -m minizero.run | bench | memory | scale | consolidate | grade.
"""

from minizero.construct import sharded_init
from minizero.fsdp import FullyShardedDataParallel
from minizero.initialize import initialize
from minizero.launcher import launch
from minizero.wrap import wrap

__all__ = ["FullyShardedDataParallel", "initialize", "launch", "sharded_init", "wrap"]
