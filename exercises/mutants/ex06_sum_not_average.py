"""Mutant: reduce-scatters with a sum instead of an average, so SGD steps N times too far."""

import torch

from minizero import comm


def reduce_scatter_bucket(params, padded_numel):
    staging = torch.zeros(padded_numel, dtype=params[0].dtype)
    offset = 0
    for p in params:
        if p.grad is not None:
            staging[offset: offset + p.numel()] = p.grad.reshape(-1)
        offset += p.numel()
        p.grad = None
    n, r = padded_numel // comm.world_size(), comm.rank()
    return staging, comm.reduce_scatter(
        staging[r * n : (r + 1) * n], staging, op="sum", async_op=True
    )
