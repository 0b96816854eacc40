"""Mutant: forgets that autograd runs a Function's backward with grad disabled: the recompute builds
no graph, so there is nothing to backpropagate through."""

import torch

from solutions.ex11_checkpoint_unit import CheckpointFunction as Right


class CheckpointFunction(Right):
    @staticmethod
    def backward(ctx, *grads):
        inputs = [
            x.detach().requires_grad_(g)
            for x, g in zip(ctx.saved_tensors, ctx.needs_input_grad[1:])
        ]
        output = ctx.run(*inputs)
        torch.autograd.backward(output, grads)
        return (None, *(x.grad for x in inputs))


def checkpoint(run, *inputs):
    return CheckpointFunction.apply(run, *inputs)
