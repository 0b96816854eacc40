"""Exercise 15, answer: Megatron's column- and row-parallel linear layers with f and g.
minizero's own version is minizero/beyond/tensor_parallel.py (over a group of the ranks, and with
the vocabulary-parallel embedding and loss)."""

import torch
import torch.nn.functional as F

from minizero import comm


class CopyToRanks(torch.autograd.Function):
    """f: the identity forward; backward, the input's gradient summed over the ranks."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        comm.all_reduce(grad, op="sum")
        return grad


class ReduceFromRanks(torch.autograd.Function):
    """g: forward, the partial outputs summed over the ranks; the identity backward."""

    @staticmethod
    def forward(ctx, partial):
        out = partial.contiguous().clone()
        comm.all_reduce(out, op="sum")
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


def shard_columns(linear):
    m, r = comm.world_size(), comm.rank()
    weight = linear.weight.detach().chunk(m, dim=0)[r].clone()      # [out/M, in]
    bias = linear.bias.detach().chunk(m, dim=0)[r].clone()          # [out/M]
    return weight, bias


def shard_rows(linear):
    m, r = comm.world_size(), comm.rank()
    return linear.weight.detach().chunk(m, dim=1)[r].clone()       # [out, in/M]


def column_parallel(x, weight, bias):
    return F.linear(CopyToRanks.apply(x), weight, bias)


def row_parallel(x_shard, weight, bias):
    return ReduceFromRanks.apply(F.linear(x_shard, weight)) + bias
