"""Design (a): keep ZeRO's partitions, gather only the matrices that straddle a boundary.

    engine = minizero.wrap(model, 2, functools.partial(torch.optim.Muon, lr=0.02))  # the default
    python -m pytest tests/test_muon.py -k straddle

Moonlight's distributed Muon (Liu et al. 2025, "Muon is Scalable for LLM Training") and, in spirit,
DeepSpeed's stages 1-2 (which give every rank that owns part of a matrix the whole reduced
gradient). The layout is ZeRO's, unchanged; each rank holds the momentum of its own elements (Ψ/N,
as Adam's moments) and computes U on them. Then, per matrix:

  * whole in this rank's partition (most of them): Newton-Schulz right here, no communication;
  * straddling ranks first..last (at most N-1 per bucket, one per boundary): every rank of the
    group all-gathers the pieces of U, padded to the longest piece L; the holders cut the matrix
    out of the result and each orthogonalizes it (the same input, so the same O on each: the
    redundancy is the price of not moving O), then keeps its own piece.

U travels in bf16: Newton-Schulz's first step rounds it to bf16 anyway, so the matrix each holder
rebuilds is bit for bit what one process orthogonalizes, for half the bytes of fp32.

Cost per step, per rank (tests/test_muon.py measures it against these): (N-1)·L·2 bytes sent per
straddling matrix (ring all-gather of N·L bf16 elements), nothing for the others; momentum 4 bytes
per owned element (exactly Ψ_muon/N); a transient N·L-element buffer while one straddler is
gathered; Newton-Schulz once per whole matrix and once per holder of a straddling one.
"""

from __future__ import annotations

import torch

from minizero import comm
from minizero.beyond.muon.pieces import Design, Matrix, Piece


class GatherStraddlers(Design):
    """(a): whole pieces are orthogonalized here, straddling ones after an all-gather."""

    def orthogonalize(self, todo: list[tuple[Piece, torch.Tensor, dict]], settings_of) -> list:
        mine = {id(piece.param): (piece, u) for piece, u, _ in todo}
        out = {}
        for m in self.straddlers():                  # every rank, in the same order
            piece, u = mine.get(id(m.param), (None, None))
            longest = self.longest(m)
            sent = torch.zeros(longest, dtype=self.wire, device=comm.device())
            if piece is not None:
                sent[:piece.numel] = u
            gathered = torch.empty(longest * self.n, dtype=self.wire, device=comm.device())
            # <- the essential line of (a): only a straddling matrix travels      [N · L]
            comm.all_gather(gathered, sent, group=self.group, tag="Muon U, straddling matrix")
            if piece is not None:
                whole = torch.cat([gathered[r * longest: r * longest + end - begin]
                                   for r, begin, end in m.holders]).view(m.param.shape)
                o = self.kernel(whole, settings_of(m.param)).reshape(-1)
                out[id(piece)] = o[piece.begin:piece.end].to(u.device)
        return [self.kernel(u.view(piece.param.shape), group).reshape(-1) if piece.whole
                else out[id(piece)] for piece, u, group in todo]

    def straddlers(self) -> list[Matrix]:
        return [m for m in self.layout.matrices if m.straddles]

    @staticmethod
    def longest(m: Matrix) -> int:
        """L: the longest piece of a straddling matrix, what every rank sends for it."""
        return max(end - begin for _, begin, end in m.holders)

    def sent_bytes(self) -> int:
        size = torch.finfo(self.wire).bits // 8
        return int(sum(comm.ring_bytes("all_gather", self.n * self.longest(m) * size, self.n)
                       for m in self.straddlers()))                     # (N-1)·L·2 each

    def newton_schulz_calls(self) -> int:
        return sum(len(pieces) for pieces in self.layout.pieces)       # every piece: its matrix
