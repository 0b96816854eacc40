"""Mutant: gathers every straddling matrix but keeps O only on the rank where the matrix begins:
the ranks holding its later pieces leave them at 0."""

import torch

from solutions.ex16_muon_designs import orthogonalize_round_robin  # noqa: F401
from minizero import comm


def orthogonalize_straddlers(matrices, u_part, newton_schulz):
    n, rank, size = comm.world_size(), comm.rank(), u_part.numel()
    mine = (rank * size, (rank + 1) * size)
    o_part = torch.zeros_like(u_part)
    for offset, (rows, cols) in matrices:
        start, end = offset, offset + rows * cols
        first, last = start // size, (end - 1) // size
        lo, hi = max(start, mine[0]), min(end, mine[1])
        if first == last:
            if first == rank:
                o_part[lo - mine[0]:hi - mine[0]] = newton_schulz(
                    u_part[lo - mine[0]:hi - mine[0]].view(rows, cols)).reshape(-1)
            continue
        pieces = [(max(start, r * size), min(end, (r + 1) * size)) for r in range(first, last + 1)]
        longest = max(b - a for a, b in pieces)
        sent = torch.zeros(longest)
        if lo < hi:
            sent[:hi - lo] = u_part[lo - mine[0]:hi - mine[0]]
        gathered = torch.empty(n * longest)
        comm.all_gather(gathered, sent)
        if first == rank:                                  # <- "my matrix": where it begins
            whole = torch.cat([gathered[r * longest:r * longest + b - a]
                               for r, (a, b) in zip(range(first, last + 1), pieces)])
            o = newton_schulz(whole.view(rows, cols)).reshape(-1)
            o_part[lo - mine[0]:hi - mine[0]] = o[lo - start:hi - start]
    return o_part
