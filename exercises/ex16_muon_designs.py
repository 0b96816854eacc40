"""Exercise 16: Muon under ZeRO, Newton-Schulz on whole matrices when each rank holds a partition.

    Grade it:    pytest exercises -k ex16            (or: python -m minizero.grade -k ex16)
    Notebook:    notebooks/11_muon.ipynb
    Compare:     minizero/beyond/muon/straddle.py (GatherStraddlers) and
                 minizero/beyond/muon/round_robin.py (RoundRobin)

Muon (torch.optim.Muon) updates a matrix W with O = NS(U): U is the momentum-updated gradient,
element by element, and NS is a Newton-Schulz iteration that needs the WHOLE matrix. ZeRO lays the
matrices of a bucket end to end, pads the bucket to a multiple of N and gives rank r partition r:
partition_size elements from r * partition_size. So a matrix is either whole in one partition or
straddles a boundary, a piece on each of several ranks. Each rank has computed U on its own
elements (the momentum is element-wise); the step needs O on its own elements.

Write, for one bucket (this rank is comm.rank() of N = comm.world_size()):
  * orthogonalize_straddlers(matrices, u_part, newton_schulz) -> o_part: design (a), Moonlight's.
    A matrix whole in this rank's partition: O = newton_schulz(its U), here. A matrix that
    straddles: all-gather its pieces of U (every rank takes part in every such all-gather, in the
    order of `matrices`, with a piece or zeros), rebuild the matrix, newton_schulz it and keep this
    rank's piece of O. Nothing travels for a matrix that does not straddle.
  * orthogonalize_round_robin(matrices, u_part, newton_schulz) -> o_part: design (c), DeepSpeed's
    stage 3. All-gather the whole bucket's U; matrix k (its index in `matrices`) is orthogonalized
    by rank k mod N alone, which writes its O into a bucket-sized buffer of zeros; a reduce-scatter
    with op="sum" then gives every rank the O of its own partition.
Arguments: matrices, a list of (offset, (rows, cols)): where each matrix starts in the bucket and
its shape (other elements of the bucket are not Muon's: their O is 0, and so is the padding's);
u_part [partition_size], this rank's slice of the bucket's U (fp32; 0 outside the matrices);
newton_schulz(u [rows, cols]) -> O [rows, cols], torch's kernel with the right settings. Return
o_part [partition_size] (any float dtype; the grader adds it to the weights).

What the grader checks: three ranks train a model whose matrices straddle at N = 3 (and a tied
embedding and a frozen matrix) with torch's Muon for its matrices and AdamW for the rest, at stage 1
and at stage 3, your function in place of minizero's design; every rank must end where one process
running torch.optim.Muon and torch.optim.AdamW ends (1e-5). And what each sends: (a) nothing for a
matrix that does not straddle, at most N x its longest piece in fp32 for one that does; (c) Newton-
Schulz exactly once per matrix, on rank k mod N.

Hints:
  * where matrix i's elements are: [offset, offset + rows * cols) of the bucket; this rank's are
    [rank * P, (rank + 1) * P) with P = u_part.numel(). A matrix straddles when the first and the
    last of its elements are in different partitions.
  * comm.all_gather(out [N * L], mine [L]) puts rank r's L elements at out[r * L:(r + 1) * L]:
    pad each rank's piece to the longest piece L; rank r's piece then starts at r * L of the
    result, and the pieces are in rank order, so the matrix is their concatenation.
  * comm.reduce_scatter(out [P], full [N * P], op="sum"): its input is workspace afterwards.
"""

import torch  # noqa: F401  (your answer will need it)

from minizero import comm  # noqa: F401  (your answer will need it)


def orthogonalize_straddlers(matrices, u_part, newton_schulz):
    """Design (a): O of this rank's partition, gathering only the matrices that straddle."""
    raise NotImplementedError("ex16: write orthogonalize_straddlers")


def orthogonalize_round_robin(matrices, u_part, newton_schulz):
    """Design (c): O of this rank's partition, matrix k orthogonalized by rank k mod N."""
    raise NotImplementedError("ex16: write orthogonalize_round_robin")
