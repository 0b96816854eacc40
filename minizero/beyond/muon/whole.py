"""Design (b): bend the layout so that no matrix straddles: each rank owns whole matrices.

    engine = minizero.wrap(model, 2, functools.partial(torch.optim.Muon, lr=0.02),
                           muon_design="whole")
    python -m pytest tests/test_muon.py -k whole

nanochat's DistMuon, Megatron's layer-wise distributed optimizer, torch's ZeroRedundancyOptimizer
partition: a rank owns whole parameters instead of a slice of the flat buffer. minizero keeps its
one flat layout (flat.py: equal partitions, padded to a multiple of N) and changes only the bucket
rule, the table's `buckets` column (stages.py): the Muon matrices are put in buckets of N matrices
of one shape. Such a bucket is N·M elements, its N partitions are M each, so partition r *is*
matrix r: the engine's own reduce-scatter hands rank r the whole averaged gradient of its matrix,
its own all-gather shares the result, and Newton-Schulz runs once per matrix, on its owner, with no
communication of its own: straddle.py finds nothing to gather.

    shapes   q0 q1 q2 q3 (d×d)  fc0 fc1 (4d×d)     N = 2
    buckets  [q0 q1] [q2 q3] [fc0 fc1] [the rest, by the stage's own rule]

Balanced by shape: each rank gets one matrix of each bucket. A shape whose count is not a multiple
of N leaves k < N matrices that equal partitions cannot hand to k ranks whole (a bucket of k·M
elements is cut into N slices of k·M/N): they join the rest, where straddle.py gathers any that
straddles (nanochat pads with zero matrices instead, which costs their memory and compute). The
buckets follow backward's order (the bucket whose gradients complete first goes first), but a
bucket of one shape spans N layers, so at stage 2 it completes only at the earliest of them: less
overlap than size-ordered buckets. Stage 3 cannot take it: its buckets are its units, the model's
modules, gathered in forward.

Cost per step, per rank: no bytes beyond ZeRO's own 2Ψ (the engine's reduce-scatter and
all-gather), plus what straddle.py sends for the leftovers; momentum 4 bytes per owned element
(Ψ_muon/N: the partitions are equal); Newton-Schulz once per matrix.
"""

from __future__ import annotations

from torch import nn


def whole_matrix_buckets(rest_rule, n: int, muon: set[int]):
    """The bucket rule of design (b) for N = n ranks: buckets of n same-shape Muon matrices (ids
    in `muon`), then `rest_rule(others, bucket_size)` (the stage's own rule) for everything else,
    ordered as backward completes them."""

    def rule(trainable: list[nn.Parameter], bucket_size: float) -> list[list[nn.Parameter]]:
        by_shape: dict[tuple, list[nn.Parameter]] = {}
        for p in reversed(trainable):                            # backward's order
            if id(p) in muon:
                by_shape.setdefault(tuple(p.shape), []).append(p)
        buckets = []
        for same in by_shape.values():
            whole = len(same) - len(same) % n
            buckets += [same[i: i + n] for i in range(0, whole, n)]
        owned = {id(p) for b in buckets for p in b}
        buckets += rest_rule([p for p in trainable if id(p) not in owned], bucket_size)
        arrival = {id(p): i for i, p in enumerate(reversed(trainable))}
        return sorted(buckets, key=lambda b: max(arrival[id(p)] for p in b))

    return rule
