"""Mutant: round-robin where every rank orthogonalizes and writes every matrix before the sum:
each element gets N copies of O."""

import torch

from solutions.ex16_muon_designs import orthogonalize_straddlers  # noqa: F401
from minizero import comm


def orthogonalize_round_robin(matrices, u_part, newton_schulz):
    n, size = comm.world_size(), u_part.numel()
    full = torch.empty(n * size)
    comm.all_gather(full, u_part.contiguous())
    orthogonal = torch.zeros_like(full)
    for offset, (rows, cols) in matrices:                         # <- not only k mod N
        orthogonal[offset:offset + rows * cols] = newton_schulz(
            full[offset:offset + rows * cols].view(rows, cols)).reshape(-1)
    o_part = torch.empty_like(u_part)
    comm.reduce_scatter(o_part, orthogonal, op="sum")
    return o_part
