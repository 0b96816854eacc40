"""minizero: data-parallel training with ZeRO, small enough to read in an afternoon.

    import functools, torch, minizero
    engine = minizero.wrap(model, stage=2, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    results = minizero.launch(worker_fn, world_size=4)      # run a function on 4 ranks

Reading order: comm.py -> flat.py -> reducer.py -> optim.py -> ddp.py -> zero1.py -> zero2.py -> zero3.py
-> offload.py. Entry points: python -m minizero.run | minizero.bench | minizero.memory | minizero.grade.
"""

# launcher and wrap import neither memory.py nor run.py, so `python -m minizero.memory` / `.run` do not
# find their own module already imported by the package (runpy warns about that).
from minizero.launcher import launch
from minizero.wrap import wrap

__all__ = ["launch", "wrap"]
