"""Exercise 4, answer: minizero's padding (flat.padded_size) and stage 1's all-gather (zero1.py)."""

from minizero import comm
from minizero.flat import padded_size as padded_numel

__all__ = ["padded_numel", "partition", "all_gather_params"]


def partition(numel, world_size, rank):
    size = padded_numel(numel, world_size) // world_size       # one partition: Ψ_padded / N
    return rank * size, (rank + 1) * size


def all_gather_params(flat):
    start, end = partition(flat.numel(), comm.world_size(), comm.rank())
    comm.all_gather(flat, flat[start:end])                       # in place: my partition is the input
