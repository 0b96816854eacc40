"""Exercise 16, answer: Muon's Newton-Schulz on whole matrices over ZeRO's partitions, two ways.
minizero's own versions are minizero/beyond/muon/straddle.py and round_robin.py (over any partition
group, with the layout worked out once, U sent in bf16)."""

import torch

from minizero import comm


def _span(offset, shape):
    rows, cols = shape
    return offset, offset + rows * cols


def orthogonalize_straddlers(matrices, u_part, newton_schulz):
    n, rank, size = comm.world_size(), comm.rank(), u_part.numel()
    mine = (rank * size, (rank + 1) * size)                      # this partition, in the bucket
    o_part = torch.zeros_like(u_part)
    for offset, shape in matrices:
        start, end = _span(offset, shape)
        first, last = start // size, (end - 1) // size           # the partitions it lies in
        lo, hi = max(start, mine[0]), min(end, mine[1])          # this rank's piece, if any
        if first == last:                                        # whole in one partition
            if first == rank:
                o_part[lo - mine[0]:hi - mine[0]] = newton_schulz(
                    u_part[lo - mine[0]:hi - mine[0]].view(shape)).reshape(-1)
            continue
        pieces = [(max(start, r * size), min(end, (r + 1) * size)) for r in range(first, last + 1)]
        longest = max(b - a for a, b in pieces)
        sent = torch.zeros(longest, dtype=u_part.dtype)
        if lo < hi:
            sent[:hi - lo] = u_part[lo - mine[0]:hi - mine[0]]
        gathered = torch.empty(n * longest, dtype=u_part.dtype)
        comm.all_gather(gathered, sent)                          # every rank, every straddler
        if lo < hi:
            whole = torch.cat([gathered[r * longest:r * longest + b - a]
                               for r, (a, b) in zip(range(first, last + 1), pieces)])
            o = newton_schulz(whole.view(shape)).reshape(-1)
            o_part[lo - mine[0]:hi - mine[0]] = o[lo - start:hi - start]
    return o_part


def orthogonalize_round_robin(matrices, u_part, newton_schulz):
    n, rank, size = comm.world_size(), comm.rank(), u_part.numel()
    full = torch.empty(n * size, dtype=u_part.dtype)
    comm.all_gather(full, u_part.contiguous())                   # the whole bucket's U
    orthogonal = torch.zeros_like(full)
    for k, (offset, shape) in enumerate(matrices):
        if k % n == rank:                                        # the owner, alone
            start, end = _span(offset, shape)
            orthogonal[start:end] = newton_schulz(full[start:end].view(shape)).reshape(-1)
    o_part = torch.empty_like(u_part)
    comm.reduce_scatter(o_part, orthogonal, op="sum")            # each element: its owner's O
    return o_part
