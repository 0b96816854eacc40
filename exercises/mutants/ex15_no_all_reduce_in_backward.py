"""Mutant: f's backward is the identity too: each rank keeps its partial input gradient."""

import torch
import torch.nn.functional as F

from solutions.ex15_tensor_parallel_linear import (  # noqa: F401  (the correct rest)
    row_parallel, shard_columns, shard_rows,
)


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def column_parallel(x, weight, bias):
    return F.linear(Identity.apply(x), weight, bias)
