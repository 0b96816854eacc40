"""Mutant: round-robin without the scatter back: each rank keeps its own slice of the O buffer, so
a piece of a matrix another rank owns keeps that rank's zeros instead of the owner's O."""

import torch

from solutions.ex16_muon_designs import orthogonalize_straddlers  # noqa: F401
from minizero import comm


def orthogonalize_round_robin(matrices, u_part, newton_schulz):
    n, rank, size = comm.world_size(), comm.rank(), u_part.numel()
    full = torch.empty(n * size)
    comm.all_gather(full, u_part.contiguous())
    orthogonal = torch.zeros_like(full)
    for k, (offset, (rows, cols)) in enumerate(matrices):
        if k % n == rank:
            orthogonal[offset:offset + rows * cols] = newton_schulz(
                full[offset:offset + rows * cols].view(rows, cols)).reshape(-1)
    return orthogonal[rank * size:(rank + 1) * size].clone()    # <- no reduce-scatter
