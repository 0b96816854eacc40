"""Mutant: the shards are numbered from the end, so rank r keeps rank N-1-r's rows."""

import torch

from solutions.ex17_dim0_shards import all_gather_param, reduce_scatter_grad  # noqa: F401


def shard(param, rank, world_size):
    chunk = -(-param.shape[0] // world_size)
    padded = torch.zeros((world_size * chunk, *param.shape[1:]), dtype=param.dtype)
    padded[:param.shape[0]] = param
    return padded[(world_size - 1 - rank) * chunk:(world_size - rank) * chunk].clone()
