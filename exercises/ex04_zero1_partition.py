"""Exercise 4: ZeRO stage 1, who owns which slice of the flat buffer, and the all-gather after the
step.

    Grade it:    pytest exercises -k ex04            (or: python -m minizero.grade -k ex04)
    Notebook:    notebooks/02_zero1.ipynb
    Compare:     minizero/zero1.py, minizero/flat.py (padded_size, FlatLayout.my_partition)

Stage 1 (P_os) keeps parameters and gradients replicated but gives each rank the optimizer state of
only 1/N of the parameters: (b_p + b_g)Ψ + KΨ/N bytes instead of (b_p + b_g + K)Ψ, with b_p and b_g
the bytes of a parameter and of a gradient and K the optimizer's bytes per parameter. The paper's
bf16 Adam: 4Ψ + 12Ψ/N instead of 16Ψ; fp32 AdamW, as notebook 02 runs (no master copy, K = 8):
8Ψ + 8Ψ/N instead of 16Ψ. This grader trains in fp32 with plain SGD, which keeps no state (K = 0):
it checks the partitions and the all-gather, not the saving. To do that, lay all Ψ parameters end
to end in one flat buffer, pad it with zeros to a multiple of N, and cut it into N equal
*partitions*:

    flat buffer  | p0 (6)          | p1 (4)    | p2 (5)       |  |    Ψ = 15, + 1 of padding
    partitions   | rank 0    | rank 1    | rank 2    | rank 3    |    N = 4: 4 elements each

(one column of three characters per element). Every parameter here straddles two ranks: p0 = [0, 6)
lies in ranks 0 and 1, p1 = [6, 10) in ranks 1 and 2, p2 = [10, 15) in ranks 2 and 3, and rank 3's
partition ends with the padding. A rank owns a range of *elements*, not whole parameters.

Each step: the gradients are reduce-scattered (rank r receives the average of partition r only),
rank r's optimizer updates partition r of the parameters, and an *all-gather* copies every rank's
updated partition into everybody's flat buffer, so all replicas hold the new parameters before the
next forward. Equal partitions are what reduce-scatter and all-gather need: that is why the buffer
is padded.

Write:
  1. padded_numel(numel, world_size): numel rounded up to a multiple of world_size.
  2. partition(numel, world_size, rank): the range [start, end) of the *padded* flat buffer that
     `rank` owns. All ranks' ranges have the same length and together cover the padded buffer
     exactly.
  3. all_gather_params(flat): `flat` is a padded flat parameter buffer in which this rank's
     partition holds its freshly updated values; fill in every other rank's partition from that
     rank, in place.

What the grader checks: your padding and partitions for many (numel, N, rank); then three ranks
train a small GPT for 3 SGD steps with minizero's stage 1, where your partition decides which slice
each rank's optimizer steps and your all-gather shares the result; every rank's model must end where
one process training on the whole batch ends (its optimizer's slice and its full model parameters).

Hints:
  * ceil(a / b) for integers is -(-a // b).
  * comm.all_gather(output, input) is in place when `input` is this rank's slice of `output`.
  * comm.rank() and comm.world_size() give r and N; flat.numel() is already a multiple of N.
"""

import torch

from minizero import comm  # noqa: F401  (your answer will need it)


def padded_numel(numel: int, world_size: int) -> int:
    """numel rounded up to a multiple of world_size."""
    raise NotImplementedError("ex04: write padded_numel")


def partition(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of the padded flat buffer of `numel` real elements that `rank` owns."""
    raise NotImplementedError("ex04: write partition")


def all_gather_params(flat: torch.Tensor) -> None:
    """In place: every rank's partition of `flat` [padded] from that rank."""
    raise NotImplementedError("ex04: write all_gather_params")
