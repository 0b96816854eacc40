"""Mutant: the all-gather returns all N * chunk rows, the padding rows included."""

import torch

from minizero import comm
from solutions.ex17_dim0_shards import reduce_scatter_grad, shard  # noqa: F401


def all_gather_param(mine, shape):
    n = comm.world_size()
    full = torch.empty(n * mine.numel(), dtype=mine.dtype)
    comm.all_gather(full, mine.reshape(-1))
    return full.view(n * mine.shape[0], *mine.shape[1:])
