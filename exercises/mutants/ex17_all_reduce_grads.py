"""Mutant: averages the whole gradient with an all-reduce and keeps its rows: the right values, for
twice a reduce-scatter's bytes (every rank receives every row it then throws away)."""

import torch

from minizero import comm
from solutions.ex17_dim0_shards import all_gather_param, shard  # noqa: F401


def reduce_scatter_grad(grad):
    n, rank = comm.world_size(), comm.rank()
    chunk = -(-grad.shape[0] // n)
    padded = torch.zeros((n * chunk, *grad.shape[1:]), dtype=grad.dtype)
    padded[:grad.shape[0]] = grad
    comm.all_reduce(padded, op="avg")
    return padded[rank * chunk:(rank + 1) * chunk].clone()
