"""minizero: data-parallel training with ZeRO, small enough to read in an afternoon.

    import functools, torch, minizero
    engine = minizero.wrap(model, stage=2, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    results = minizero.launch(worker_fn, world_size=4)      # run a function on 4 ranks

Reading order: comm.py -> flat.py -> reducer.py -> optim.py -> ddp.py -> zero1.py -> zero2.py -> zero3.py
-> offload.py. Entry points: python -m minizero.run | minizero.bench | minizero.memory | minizero.grade.
"""

__all__ = ["launch", "wrap"]


def __getattr__(name):
    # Imported on first use, so that `python -m minizero.memory` (or .run, .bench) does not find its own
    # module already imported by the package (runpy warns about that) and `import minizero` stays cheap.
    if name == "launch":
        from minizero.launcher import launch
        return launch
    if name == "wrap":
        from minizero.wrap import wrap
        return wrap
    raise AttributeError(f"module 'minizero' has no attribute {name!r}")
