"""Mutant: borrows minizero's own tensor-parallel layers instead of writing f and g."""

import torch.nn.functional as F

from minizero.beyond.tensor_parallel import copy_to_group, reduce_from_group
from solutions.ex15_tensor_parallel_linear import shard_columns, shard_rows  # noqa: F401

GROUP = None


def column_parallel(x, weight, bias):
    return F.linear(copy_to_group(x, GROUP), weight, bias)


def row_parallel(x_shard, weight, bias):
    return reduce_from_group(F.linear(x_shard, weight), GROUP) + bias
