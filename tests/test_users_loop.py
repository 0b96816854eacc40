"""PyTorch's habits meet minizero's engines: nothing differs silently.

    python -m pytest tests/test_users_loop.py

A PyTorch user's loop calls zero_grad() (torch >= 2.0: set_to_none=True), writes loss.backward()
and may hand one model to two wrappers. Measured before this file: model.zero_grad() before each
backward left stage 1's parameters where they started (0.0344 from one process after 3 SGD steps);
a stage-0 engine for the gradients plus a stage-1 engine as a sharded optimizer ended 0.518 away,
silently. Each loop below must end where one process ends (fp32 1e-5) or be refused in one line.
"""

from __future__ import annotations

import functools

import pytest
import torch

import minizero
from minizero import comm
from minizero.lab.data import global_batch, local_batch
from minizero.lab.model import make_model
from minizero.lab.reference import max_abs_diff, reference_train
from minizero.lab.train import TrainConfig, loss_fn

N, STEPS, BATCH = 2, 3, 8
CFG = TrainConfig(model="tiny", optimizer="sgd", lr=0.5, steps=STEPS, batch_size=BATCH,
                  world_size=N)
# How each loop clears the gradients, then runs backward: (name, clear, backward)
LOOPS = {
    "model.zero_grad()": (lambda model, engine: model.zero_grad(), "engine"),
    "model.zero_grad(set_to_none=False)":
        (lambda model, engine: model.zero_grad(set_to_none=False), "engine"),
    "loss.backward()": (lambda model, engine: None, "loss"),
    "model.zero_grad() + loss.backward()": (lambda model, engine: model.zero_grad(), "loss"),
}
# initialize's engine (DeepSpeed's): engine.zero_grad() each step, engine.backward and loss.backward


def _train(stage: int, clear, backward: str) -> dict:
    model = make_model(CFG.model_config(), seed=CFG.seed)
    engine = minizero.wrap(model, stage, functools.partial(torch.optim.SGD, lr=CFG.lr))
    for step in range(STEPS):
        x, y = global_batch(step, BATCH, CFG.model_config().block_size, seed=CFG.seed)
        x, y = local_batch(x, y, comm.rank(), comm.world_size())
        clear(model, engine)
        loss = loss_fn(engine(x), y)
        engine.backward(loss) if backward == "engine" else loss.backward()
        engine.step()
    return engine.full_state_dict()


def users_loops() -> dict:
    """Worker: every loop at every stage; the DeepSpeed front end's engine.zero_grad(); fp16 with
    loss.backward(); a second owner of the same parameters."""
    out = {}
    for stage in range(4):
        for name, (clear, backward) in LOOPS.items():
            out[stage, name] = _train(stage, clear, backward)
        # DeepSpeed's front end: engine.zero_grad() between micro-batches, as its scripts do
        model = make_model(CFG.model_config(), seed=CFG.seed)
        config = {"train_batch_size": BATCH, "zero_optimization": {"stage": stage},
                  "gradient_clipping": 0.0,   # DeepSpeed clips at 1.0 by default
                  "optimizer": {"type": "SGD", "params": {"lr": CFG.lr}}}
        engine, *_ = minizero.initialize(model=model, model_parameters=model.parameters(),
                                         config=config)
        for step in range(STEPS):
            x, y = global_batch(step, BATCH, CFG.model_config().block_size, seed=CFG.seed)
            x, y = local_batch(x, y, comm.rank(), comm.world_size())
            engine.zero_grad()
            if step % 2:
                loss_fn(engine(x), y).backward()        # without accumulation the same step
            else:
                engine.backward(loss_fn(engine(x), y))
            engine.step()
        out[stage, "initialize: engine.zero_grad()"] = engine.engine.full_state_dict()
        # with accumulation, loss.backward() would miss the loss's 1/K: refused
        model = make_model(CFG.model_config(), seed=CFG.seed)
        engine, *_ = minizero.initialize(
            model=model, model_parameters=model.parameters(),
            config={**config, "gradient_accumulation_steps": 2, "train_batch_size": BATCH})
        x, y = local_batch(*global_batch(0, BATCH, CFG.model_config().block_size), comm.rank(),
                           2 * N)
        try:
            loss_fn(engine(x), y).backward()
            out[stage, "accumulation: loss.backward()"] = "trained"
        except RuntimeError as e:
            out[stage, "accumulation: loss.backward()"] = str(e)
        # fp16 needs its loss scaled: loss.backward() alone is refused
        model = make_model(CFG.model_config(), seed=CFG.seed)
        engine = minizero.wrap(model, stage, functools.partial(torch.optim.SGD, lr=0.1),
                               dtype="fp16")
        x, y = local_batch(*global_batch(0, BATCH, CFG.model_config().block_size), comm.rank(), N)
        try:
            loss_fn(engine(x), y).backward()
            out[stage, "fp16 loss.backward()"] = "trained"
        except RuntimeError as e:
            out[stage, "fp16 loss.backward()"] = str(e)
    # FairScale's FullyShardedDataParallel: the user's optimizer and zero_grad(), both spellings
    for set_to_none in (True, False):
        model = minizero.FullyShardedDataParallel(make_model(CFG.model_config(), seed=CFG.seed))
        optimizer = torch.optim.SGD(model.parameters(), lr=CFG.lr)
        for step in range(STEPS):
            x, y = global_batch(step, BATCH, CFG.model_config().block_size, seed=CFG.seed)
            x, y = local_batch(x, y, comm.rank(), comm.world_size())
            optimizer.zero_grad(set_to_none=set_to_none)
            loss_fn(model(x), y).backward()
            optimizer.step()
        out["fsdp", f"zero_grad(set_to_none={set_to_none})"] = {
            k: v.float() for k, v in model.state_dict().items()}
    # two owners: a stage-0 engine for the gradients, then a stage-1 engine as the optimizer
    model = make_model(CFG.model_config(), seed=CFG.seed)
    sgd = functools.partial(torch.optim.SGD, lr=CFG.lr)
    minizero.wrap(model, 0, sgd)
    for second in (lambda: minizero.wrap(model, 1, sgd),
                   lambda: minizero.FullyShardedDataParallel(model)):
        try:
            second()
            out.setdefault("second owner", []).append("taken")
        except ValueError as e:
            out.setdefault("second owner", []).append(str(e))
    return out


@pytest.fixture(scope="module")
def runs():
    return minizero.launch(users_loops, N, backend="gloo")


@pytest.fixture(scope="module")
def reference():
    return reference_train(CFG)["state_dict"]


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("loop", [*LOOPS, "initialize: engine.zero_grad()"])
def test_the_users_loop_ends_where_one_process_ends(runs, reference, stage, loop):
    for rank in runs:
        assert max_abs_diff(rank[stage, loop], reference) <= 1e-5, (stage, loop)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_fairscales_front_end_with_zero_grad_ends_where_one_process_ends(runs, reference,
                                                                        set_to_none):
    for rank in runs:
        state = rank["fsdp", f"zero_grad(set_to_none={set_to_none})"]
        assert max_abs_diff(state, reference) <= 1e-5


@pytest.mark.parametrize("stage", range(4))
def test_loss_backward_with_deepspeeds_accumulation_is_refused_in_one_line(runs, stage):
    for rank in runs:
        message = rank[stage, "accumulation: loss.backward()"]
        assert message.startswith("gradient_accumulation_steps is 2: call engine.backward(loss)")
        assert "\n" not in message


@pytest.mark.parametrize("stage", range(4))
def test_fp16_loss_backward_alone_is_refused_in_one_line(runs, stage):
    for rank in runs:
        message = rank[stage, "fp16 loss.backward()"]
        assert message.startswith("fp16: call engine.backward(loss), not loss.backward()")
        assert "\n" not in message


def test_a_second_owner_of_the_parameters_is_refused_in_one_line(runs):
    for rank in runs:
        for message in rank["second owner"]:
            assert message.startswith("tok_emb.weight is already owned by a minizero stage-0 "
                                      "engine")
            assert "\n" not in message
