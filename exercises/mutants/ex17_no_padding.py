"""Mutant: each rank takes d0 // N rows and nothing pads the rest: the rows past N * (d0 // N) are
lost, and the shards are too short for the all-gather where N does not divide d0."""

from solutions.ex17_dim0_shards import all_gather_param, reduce_scatter_grad  # noqa: F401


def shard(param, rank, world_size):
    rows = param.shape[0] // world_size
    return param[rank * rows:(rank + 1) * rows].clone()
