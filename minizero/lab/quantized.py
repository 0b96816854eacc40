"""ZeRO++'s quantized communication measured (minizero/beyond/quantize.py): bytes, one step's
error, convergence.

    minizero.launch(quantized_experiment, 3, [TrainConfig(stage=3, quantized_weights=True), ...])

Used by tests/test_quantize.py and notebook 08. `one_step` trains a 3-layer MLP whose every bucket
cuts into whole blocks (Ψ = 432, units of 144, N = 3, B = 16), so the bytes a step sends equal
memory.comm_volume exactly, once per variant: plain, qwZ, qgZ and both, at stages 2 and 3.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from minizero import comm
from minizero.lab.train import train_several
from minizero.wrap import wrap

VARIANTS = {"stage 2": (2, {}), "stage 2 qgZ": (2, {"quantized_gradients": True}),
            "stage 3": (3, {}), "stage 3 qwZ": (3, {"quantized_weights": True}),
            "stage 3 qgZ": (3, {"quantized_gradients": True}),
            "stage 3 qwZ+qgZ": (3, {"quantized_weights": True, "quantized_gradients": True})}
WIDTH, ROWS = 12, 8            # 3 layers of 12 x 12 = 432 parameters; 8 rows per rank
PSI, LR = 3 * WIDTH * WIDTH, 0.1


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH, bias=False),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH, bias=False),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH, bias=False),
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step `step`'s global batch: inputs and a smooth target."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(ROWS * comm.world_size(), WIDTH, generator=g)
    y = torch.sin(x.roll(1, dims=1)) * 0.5
    rows = slice(comm.rank() * ROWS, (comm.rank() + 1) * ROWS)
    return x[rows], y[rows]


def one_step(name: str, block: int = 16, lr: float = LR) -> dict:
    """One SGD step of `name` (VARIANTS) on the MLP: the bytes it sent by collective, the
    parameters after it, the loss; and, at stage 3, the weights each layer computed with in forward
    and in backward."""
    stage, options = VARIANTS[name]
    model = mlp()
    layers = [model[0], model[2], model[4]]
    units = {"units": layers} if stage == 3 else {"bucket_size": 1e9}          # stage 2: one bucket
    engine = wrap(model, stage, functools.partial(torch.optim.SGD, lr=lr), quantization_block=block,
                  **units, **options)
    seen = {"forward": [], "backward": []}

    def record(when: str, m: nn.Module) -> None:
        seen[when].append(m.weight.detach().clone())

    def before_backward(m: nn.Module, args, out) -> None:
        out.register_hook(lambda grad: record("backward", m))

    for layer in layers:        # registered after the engine's hooks: they see the gathered weights
        layer.register_forward_pre_hook(lambda m, args: record("forward", m))
        layer.register_forward_hook(before_backward)
    x, y = batch(0)
    comm.reset_tally()
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    tally = comm.tally()
    return {"tally": tally, "state": engine.full_state_dict(), "loss": loss.item(),
            "forward": seen["forward"], "backward": seen["backward"][::-1]}


def local_gradient_max() -> float:
    """max |g| over the elements of every rank's own (not yet averaged) gradient of step 0: what
    bounds the scales qgZ quantizes with."""
    model = mlp()
    x, y = batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    top = torch.stack([p.grad.abs().max() for p in model.parameters()]).max()
    comm.all_reduce(top, op="max")
    return top.item()


def quantized_experiment(cfgs: list, block: int = 16) -> dict:
    """Worker: one_step for every variant, the exact initial weights and local gradient bound, then
    the training runs `cfgs` (TrainConfigs: loss curves, bytes per step)."""
    return {"one_step": {name: one_step(name, block) for name in VARIANTS},
            "initial": {k: v.clone() for k, v in mlp().state_dict().items()},
            "grad_max": local_gradient_max(), "runs": train_several(cfgs)}
