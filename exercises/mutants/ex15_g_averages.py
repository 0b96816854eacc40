"""Mutant: g averages the partial outputs where it must sum them."""

import torch
import torch.nn.functional as F

from minizero import comm
from solutions.ex15_tensor_parallel_linear import (  # noqa: F401  (the correct rest)
    column_parallel, shard_columns, shard_rows,
)


class AveragingReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial):
        out = partial.contiguous().clone()
        comm.all_reduce(out, op="avg")
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


def row_parallel(x_shard, weight, bias):
    return AveragingReduce.apply(F.linear(x_shard, weight)) + bias
