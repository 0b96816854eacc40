"""Mutant: why recompute? forward runs the unit with grad enabled and keeps its graph on ctx;
backward backpropagates through that graph. Right gradients, and every activation kept: no memory
saved."""

import torch


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, *inputs):
        with torch.enable_grad():
            ctx.inputs = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
            ctx.output = run(*ctx.inputs)
        return ctx.output.detach()

    @staticmethod
    def backward(ctx, *grads):
        torch.autograd.backward(ctx.output, grads)
        return (None, *(x.grad for x in ctx.inputs))


def checkpoint(run, *inputs):
    return CheckpointFunction.apply(run, *inputs)
