"""Mutant: lets minizero's DDP engine accumulate (engine.no_sync()) instead of writing the
accumulation."""

import contextlib

import minizero

_engines: dict = {}                                  # model -> its engine, built on the first step


def train_step(model, optimizer, micro_batches, loss_fn):
    engine = _engines.setdefault(model, minizero.wrap(model, 0, lambda params: optimizer))
    step_loss = 0.0
    for i, (inputs, targets) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else engine.no_sync():
            loss = loss_fn(engine(inputs), targets) / len(micro_batches)
            engine.backward(loss)
        step_loss += loss.item()
    engine.step()
    return step_loss
