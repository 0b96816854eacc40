"""Mutant: borrows minizero's own tensor-parallel layers instead of writing f and g."""

import torch.nn.functional as F

from minizero import comm
from minizero.tensor_parallel import copy_to_group, reduce_from_group

GROUP = None


def shard_columns(linear):
    m, r = comm.world_size(), comm.rank()
    return (linear.weight.detach().chunk(m, 0)[r].clone(),
            linear.bias.detach().chunk(m, 0)[r].clone())


def shard_rows(linear):
    return linear.weight.detach().chunk(comm.world_size(), 1)[comm.rank()].clone()


def column_parallel(x, weight, bias):
    return F.linear(copy_to_group(x, GROUP), weight, bias)


def row_parallel(x_shard, weight, bias):
    return reduce_from_group(F.linear(x_shard, weight), GROUP) + bias
