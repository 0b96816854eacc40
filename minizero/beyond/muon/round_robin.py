"""Design (c): gather U of every matrix, orthogonalize whole matrices round-robin, scatter back.

    engine = minizero.wrap(model, 3, functools.partial(torch.optim.Muon, lr=0.02),
                           muon_design="round_robin")
    python -m pytest tests/test_muon.py -k round_robin

DeepSpeed's stage 3 (0.19.8, Stage3ZeroOptimizer's Muon sub-groups). Stage 3's buckets are its
units, fixed by the model's modules, so the layout cannot be bent round the matrices as design (b)
bends it. Instead, per bucket (a unit at stage 3), every rank:

  1. computes U on its own elements (momentum by element, Ψ/N, as Adam's moments) and all-gathers
     the bucket's U: every rank now holds every matrix of the bucket whole;
  2. orthogonalizes the matrices it owns: matrix k of the layout (in order) belongs to rank k mod N,
     so each Newton-Schulz runs exactly once, spread over the ranks;
  3. writes its O into a zero buffer of the bucket's size and reduce-scatters it with a sum: each
     element has one non-zero term (its owner's), so rank r's partition receives exactly the O of
     its own elements (x + 0 = x, no rounding), which it applies.

DeepSpeed gathers the momentum itself and all-gathers updates and momentum back; U is what
Newton-Schulz needs, and the momentum never has to leave its rank, since its update is element-wise
(update.py). Both directions travel in bf16 (Newton-Schulz's precision, bit for bit, straddle.py).

Cost per step, per rank: all-gather (N-1)/N·Ψ_b·2 + reduce-scatter (N-1)/N·Ψ_b·2 bytes for every
bucket holding a Muon matrix (Ψ_b its padded size); momentum 4 bytes per owned element (Ψ_muon/N);
transient 2 · 2Ψ_b bytes (U and O of one bucket): a unit at stage 3, but the whole model at stage
1, whose one bucket is everything, which is why this is stage 3's design; Newton-Schulz once per
matrix, k mod N: balanced by count, not by size.
"""

from __future__ import annotations

import torch

from minizero import comm
from minizero.beyond.muon.pieces import Design, Piece


class RoundRobin(Design):
    """(c): each matrix orthogonalized by one rank, k mod N, the results scattered back."""

    def __init__(self, layout):
        super().__init__(layout)
        self.owner = {id(m.param): k % self.n for k, m in enumerate(layout.matrices)}
        self.buckets = sorted({m.bucket for m in layout.matrices})    # those with Muon matrices

    def orthogonalize(self, todo: list[tuple[Piece, torch.Tensor, dict]], settings_of) -> list:
        device, out = comm.device(), {}
        for i in self.buckets:
            bucket = self.layout.placement.buckets[i]
            pieces = [(piece, u) for piece, u, _ in todo if piece.part == i]
            mine = torch.zeros(bucket.shard_numel, dtype=self.wire, device=device)    # [Ψ_b/N]
            for piece, u in pieces:
                mine[piece.at: piece.at + piece.numel] = u
            full = torch.empty(bucket.padded_numel, dtype=self.wire, device=device)   # [Ψ_b]
            comm.all_gather(full, mine, group=self.group, tag=f"Muon U, bucket {i}")
            orthogonal = torch.zeros_like(full)                           # [Ψ_b], O where owned
            for m in self.layout.matrices:
                if m.bucket == i and self.owner[id(m.param)] == self.me:   # <- (c): k mod N
                    span = slice(m.offset, m.offset + m.param.numel())
                    orthogonal[span] = self.kernel(full[span].view(m.param.shape),
                                                   settings_of(m.param)).reshape(-1)
            comm.reduce_scatter(mine, orthogonal, op="sum", group=self.group,
                                tag=f"Muon O, bucket {i}")               # mine <- O of my elements
            for piece, u in pieces:
                out[id(piece)] = mine[piece.at: piece.at + piece.numel].to(u.device)
        return [out[id(piece)] for piece, _, _ in todo]

    def sent_bytes(self) -> int:
        size = torch.finfo(self.wire).bits // 8
        full = [self.layout.placement.buckets[i].padded_numel * size for i in self.buckets]
        return int(sum(comm.ring_bytes("all_gather", f, self.n) +              # U: (N-1)/N·Ψ_b·2
                       comm.ring_bytes("reduce_scatter", f, self.n) for f in full))   # O: as much

    def newton_schulz_calls(self) -> int:
        return sum(owner == self.me for owner in self.owner.values())
