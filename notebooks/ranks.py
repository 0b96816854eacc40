"""What every rank runs in notebooks 01-05: one training loop, whatever the stage. Open it, edit it,
and run the notebook's launch cell again: each launch starts fresh processes, which import this file
as it is then (the cell also reloads it for the kernel).

    import minizero, ranks
    minizero.launch(ranks.train, 2, 3, "default", {"prefetch": True})   # stage 3, on 2 ranks

The stage and its options are minizero.wrap's (bucket_size, prefetch, offload, dtype, ...): the
notebooks differ in those arguments, not in this loop.
"""
import functools

import torch

import minizero
from minizero import comm
from minizero.lab.data import global_batch, local_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import loss_fn
from minizero.memory import wire


def train(stage: int, model: str = "default", options: dict | None = None, steps: int = 3,
          batch_size: int = 24) -> dict:
    """Train the small GPT `model` at `stage` for `steps` steps, each rank on its rows of each
    global batch; return its losses, engine.memory() and the bytes it sent in the last step: the
    ring's (modelled, comm.tally) and on the wire (measured, None where it cannot be)."""
    cfg = GPTConfig.named(model)
    net = make_model(cfg, seed=0)                 # the same initial weights on every rank
    engine = minizero.wrap(net, stage, functools.partial(torch.optim.AdamW, lr=1e-3),
                           **(options or {}))
    meter = None if wire.unavailable() else wire.WireMeter().start()
    losses = []
    for step in range(steps):
        comm.reset_tally()                        # count this step's bytes only
        if meter:
            meter.reset()
        x, y = global_batch(step, batch_size, cfg.block_size)        # one global batch ...
        x, y = local_batch(x, y, comm.rank(), comm.world_size())     # ... this rank's rows of it
        loss = loss_fn(engine(x.to(engine.device)), y.to(engine.device))   # stage 3: gathers
        engine.backward(loss)     # stages 0, 2, 3: each bucket / unit reduced as backward ends it
        engine.step()             # stages 1-3: the step on my partition (1-2: then all-gather)
        losses.append(loss.item())
    return {"rank": comm.rank(), "losses": losses, "memory": engine.memory(),
            "sent": comm.tally()["total"], "on_wire": meter.bytes()["total"] if meter else None}
