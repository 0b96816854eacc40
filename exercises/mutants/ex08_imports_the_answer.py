"""Mutant: wraps the model with minizero's own stage 3 instead of building one."""

import torch

import minizero


class Zero3:
    def __init__(self, model, units, lr, max_norm):
        self.engine = minizero.wrap(
            model,
            3,
            lambda params: torch.optim.SGD(params, lr=lr),
            units=units[1:],
            clip_grad_norm=max_norm,
        )

    def __call__(self, *inputs):
        return self.engine(*inputs)

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()
        return self.engine.last_grad_norm

    def full_state_dict(self):
        return self.engine.full_state_dict()
