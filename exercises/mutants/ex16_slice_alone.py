"""Mutant: orthogonalizes each rank's piece of a straddling matrix by itself (the piece as the rows
it holds), the bug DeepSpeed once shipped, instead of gathering the whole matrix."""

import torch

from solutions.ex16_muon_designs import orthogonalize_round_robin  # noqa: F401
from minizero import comm


def orthogonalize_straddlers(matrices, u_part, newton_schulz):
    rank, size = comm.rank(), u_part.numel()
    mine = (rank * size, (rank + 1) * size)
    o_part = torch.zeros_like(u_part)
    for offset, (rows, cols) in matrices:
        start, end = offset, offset + rows * cols
        lo, hi = max(start, mine[0]), min(end, mine[1])
        if lo < hi:                                        # <- whatever this rank holds of it
            o_part[lo - mine[0]:hi - mine[0]] = newton_schulz(
                u_part[lo - mine[0]:hi - mine[0]].view(1, -1)).reshape(-1)
    return o_part
