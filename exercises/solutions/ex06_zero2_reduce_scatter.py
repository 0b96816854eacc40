"""Exercise 6, answer: the body of minizero's stage 2 hook (zero2.py, GradientShard.reduce),
written against plain parameters instead of the engine's bucket objects."""

import torch

from minizero import comm


def reduce_scatter_bucket(params, padded_numel):
    # [Ψ_b padded]
    staging = torch.zeros(padded_numel, dtype=params[0].dtype, device=comm.device())
    offset = 0
    for p in params:
        if p.grad is not None:                   # None: unused this step, reduced as zeros
            staging[offset: offset + p.numel()].copy_(p.grad.reshape(-1))
        offset += p.numel()
        p.grad = None                            # the full gradient is freed: stage 2's saving
    n, r = padded_numel // comm.world_size(), comm.rank()
    return staging, comm.reduce_scatter(
        staging[r * n : (r + 1) * n], staging, op="avg", async_op=True
    )
