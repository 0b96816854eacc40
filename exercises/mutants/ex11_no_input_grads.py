"""Mutant: the recompute and its backward are right, but backward returns no gradient for the
inputs: the gradient stops at every checkpoint, and the blocks below (and the embeddings) learn
nothing from the blocks above."""

from solutions.ex11_checkpoint_unit import CheckpointFunction as Right


class CheckpointFunction(Right):
    @staticmethod
    def backward(ctx, *grads):
        Right.backward(ctx, *grads)
        return (None,) * len(ctx.needs_input_grad)


def checkpoint(run, *inputs):
    return CheckpointFunction.apply(run, *inputs)

