"""Which pieces of which matrices a rank's partition holds: what the designs need to know.

    python -m pytest tests/test_muon.py -k pieces

ZeRO's flat layout (flat.py) lays parameters end to end in a bucket and cuts it into N equal
partitions, wherever the cuts fall. A matrix W of the bucket is then either *whole* in one rank's
partition or *straddles* a partition boundary: its elements are spread over ranks first..last,
each holding a contiguous piece, in rank order (row-major: a piece is a run of rows, the first and
last maybe partial):

    bucket    | W0 (6) |   W1 (9)    | W2 (5) |pad|      N = 3, partitions of 7
    ranks     | rank 0     | rank 1     | rank 2     |      W0 whole on rank 0; W1 straddles 0-1-2;
                                                          W2 whole on rank 2

At most N-1 matrices of a bucket straddle (one per boundary). A `Piece` is one rank's run of one
matrix; a `Matrix` is where every rank's piece of it lies, from the bucket's offsets alone, so every
rank computes the same answer without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minizero import comm
from minizero.beyond.muon.update import orthogonalized
from minizero.optim import Placement, cache_sized
from minizero.param_groups import Grouping


@dataclass(frozen=True)
class Piece:
    """This rank's elements [begin, end) of `param` (row-major): part `part`'s [at, at + numel)."""
    param: nn.Parameter
    part: int
    at: int
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.begin

    @property
    def whole(self) -> bool:
        return self.begin == 0 and self.end == self.param.numel()


@dataclass(frozen=True)
class Matrix:
    """A matrix of a bucket and where its pieces are: `offset` in the bucket, and for each rank of
    the partition group that holds some of it, (rank, begin, end) in the matrix's elements."""
    param: nn.Parameter
    bucket: int
    offset: int
    holders: tuple[tuple[int, int, int], ...]

    @property
    def straddles(self) -> bool:
        return len(self.holders) > 1


def matrices_of(bucket, index: int, is_muon) -> list[Matrix]:
    """The Muon matrices of a bucket (flat.Bucket; `index` its place in the layout), in order."""
    size = bucket.shard_numel                            # the partitions: N equal slices
    found = []
    for p, offset in zip(bucket.params, bucket.offsets):
        if not is_muon(p):
            continue
        end = offset + p.numel()
        holders = tuple((r, max(offset, r * size) - offset, min(end, (r + 1) * size) - offset)
                        for r in range(offset // size, (end - 1) // size + 1))
        found.append(Matrix(p, index, offset, holders))
    return found


class Layout:
    """Every Muon matrix of the parts an optimizer home is handed, and this rank's pieces of them.

    is_muon(p): p is stepped by Muon (in a group with use_muon, the default, of a Muon factory;
    wrap checked that each is a matrix: home.muon_engine).
    """

    def __init__(self, placement: Placement, part_sizes: list[int], grouping: Grouping | None):
        self.placement, self.grouping = placement, grouping
        self.matrices = [m for i, b in enumerate(placement.buckets)
                         for m in matrices_of(b, i, self.is_muon)]
        # this rank's pieces, part by part, in order: what the optimizer's views are cut into
        self.pieces: list[list[Piece]] = [[] for _ in part_sizes]
        for m in self.matrices:
            start, size = placement.starts[m.bucket], part_sizes[m.bucket]
            lo, hi = max(m.offset, start), min(m.offset + m.param.numel(), start + size)
            if lo < hi:
                self.pieces[m.bucket].append(
                    Piece(m.param, m.bucket, lo - start, lo - m.offset, hi - m.offset))

    def group_index(self, p: nn.Parameter) -> int | None:
        """p's parameter group (0 without groups; None: in no group, not stepped)."""
        return 0 if self.grouping is None else self.grouping.group_of.get(id(p))

    def muon_group(self, group: int | None) -> bool:
        """Whether parameter group `group` is Muon's: use_muon, True unless the group says False."""
        return group is not None and (self.grouping is None or
                                      self.grouping.settings[group].get("use_muon", True))

    def is_muon(self, p: nn.Parameter) -> bool:
        return p.requires_grad and self.muon_group(self.group_index(p))

    def cut(self, part: int, start: int, stop: int, group: int | None):
        """How the optimizer's views cut a run [start, stop) of a part (optim.cache_sized's
        contract): a Muon group's run at every piece's edge, so that each piece is one view;
        any other run into cache-sized views, as for any optimizer."""
        if not self.muon_group(group):
            return cache_sized(part, start, stop, group)
        edges = {x - start for piece in self.pieces[part]
                 for x in (piece.at, piece.at + piece.numel)}
        return sorted(x for x in edges if 0 < x < stop - start)


class Design:
    """How a partitioned Muon brings each matrix's U together for Newton-Schulz: straddle.py (a),
    round_robin.py (c); whole.py (b) is a layout under straddle.py's design. `wire`: the dtype U
    and O travel in; `kernel(u, settings)`: Newton-Schulz of a whole matrix (update.py's, torch's).
    A subclass may bring its own of either (tests/test_muon.py plugs in DeepSpeed's)."""
    wire = torch.bfloat16            # Newton-Schulz rounds U to bf16 first: bf16 loses nothing
    kernel = staticmethod(orthogonalized)

    def __init__(self, layout: Layout):
        self.layout, self.group = layout, layout.placement.group
        self.n, self.me = comm.group_size(self.group), comm.group_rank(self.group)

    def orthogonalize(self, todo: list[tuple[Piece, torch.Tensor, dict]], settings_of) -> list:
        """[(piece, its U [numel], its group's settings)] -> each piece's O [numel]; every rank
        calls it at once (it may communicate). settings_of(matrix): any matrix's group's."""
        raise NotImplementedError

    def sent_bytes(self) -> int:
        """What orthogonalize sends per step, this rank, by the ring formulas (comm.py)."""
        raise NotImplementedError

    def newton_schulz_calls(self) -> int:
        """How many matrices this rank orthogonalizes per step."""
        raise NotImplementedError
